"""The figures of the README and of every manual page are the committed result files'
(bench/report/): each page equals its render, no figure stands outside the rendered blocks, and
planted or edited figures fail."""

import re

import pytest

from bench.report import pages
from bench.report.check import check, stray_figures


@pytest.fixture(scope="module")
def every_page() -> dict[str, tuple[str, dict]]:
    return {p: ((pages.ROOT / p).read_text(), blocks) for p, blocks in pages.pages().items()}


def test_every_page_is_rendered_from_the_result_files():
    assert pages.check_all() == []


def test_every_manual_page_is_checked(every_page):
    docs = {str(p.relative_to(pages.ROOT)) for p in (pages.ROOT / "docs").glob("*.md")}
    assert docs - set(every_page) == set(pages.SPECIFICATION)
    assert "README.md" in every_page


@pytest.mark.parametrize(
    ("page", "heading"), [("README.md", "## The manual\n"), ("docs/retrieval.md", "## MQAR\n")]
)
def test_a_planted_stray_figure_fails(every_page, page, heading):
    text, blocks = every_page[page]
    planted = text.replace(heading, heading + "\nLaplace trains 4.52x faster.\n", 1)
    problems = check(planted, blocks, page)
    assert len(problems) == 1 and "stray figure" in problems[0] and "4.52" in problems[0]
    assert problems[0].split(" at ")[1].startswith(f"{page}:")
    for figure in ("took 20 s", "within 2.8e-6", "87% of answers", "a loss of 4.90"):
        assert stray_figures(f"It {figure}.\n"), figure


def test_an_edited_figure_inside_a_block_fails(every_page):
    text, blocks = every_page["docs/benchmarks.md"]
    block = re.search(r"<!-- report:train -->\n(.*?)<!-- /report -->", text, re.S)
    edited = block.group(1).replace("|", "| 1.23 |", 1)
    problems = check(text.replace(block.group(1), edited), blocks, "docs/benchmarks.md")
    assert problems and "differs" in problems[-1]


def test_stated_facts_versions_commands_and_sections_are_not_figures():
    text = "jax 0.10.0, Python 3.11, the write-up's 29.5 MB, `lr=3e-3 --steps 20`.\n"
    assert stray_figures(text) == []
    assert stray_figures("```\n12.5 s\n```\n") == []
    assert stray_figures("### 12.4 The bf16 contract\nas s13.5 says\n") == []
    assert stray_figures("## Tables\nit took 12.4 s\n")  # a figure after a heading still counts
