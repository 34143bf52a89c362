"""The README's figures are the committed result files' (bench/report.py): the README equals its
render, no figure stands outside the rendered blocks, and planted or edited figures fail."""

import re

import pytest

from bench import report


@pytest.fixture(scope="module")
def readme() -> str:
    return report.README.read_text()


def test_the_readme_is_rendered_from_the_result_files(readme):
    assert report.check(readme) == []


def test_a_planted_stray_figure_fails(readme):
    planted = readme.replace(
        "## Retrieval quality\n", "## Retrieval quality\n\nLaplace trains 4.52x faster.\n", 1
    )
    problems = report.check(planted)
    assert len(problems) == 1 and "stray figure" in problems[0] and "4.52" in problems[0]
    for figure in ("took 20 s", "within 2.8e-6", "87% of answers", "a loss of 4.90"):
        assert report.stray_figures(f"It {figure}.\n"), figure


def test_an_edited_figure_inside_a_block_fails(readme):
    block = re.search(r"<!-- report:train -->\n(.*?)<!-- /report -->", readme, re.S)
    edited = block.group(1).replace("|", "| 1.23 |", 1)
    problems = report.check(readme.replace(block.group(1), edited))
    assert problems and "differs" in problems[-1]


def test_stated_facts_versions_and_commands_are_not_figures():
    text = "jax 0.10.0, Python 3.11, the write-up's 29.5 MB, `lr=3e-3 --steps 20`.\n"
    assert report.stray_figures(text) == []
    assert report.stray_figures("```\n12.5 s\n```\n") == []
