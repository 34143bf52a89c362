"""`python -m bench.report`: the figures of the README and the manual (docs/), rendered from the
committed result files.

    python -m bench.report           # rewrite every page's figure blocks from bench/results/
    python -m bench.report --check   # exit 1 if a page differs, or quotes a stray figure

Every measured figure of a page sits between `<!-- report:NAME -->` and `<!-- /report -->`, and
the page's module here renders it (`BLOCKS[NAME]`) from the file its command wrote
(`bench/results/*.json`) or, for the model accounting, from the shapes. One module per page
(`pages.PAGES` lists them); `check.py` holds the rule for the prose around the blocks.
"""
