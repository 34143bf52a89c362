"""Every command the README and the manual show (each line of their ```bash blocks) names a
module and flags that exist: each `python -m MODULE ARGS` has ARGS parsed by MODULE's own parser,
run as `python -m` runs it (its `__main__`), stopped once they parse, all in one process of
their own (tests/doc_commands.py, whose `RUN` modules run whole, in seconds); `--help` prints
its help. Other programs must be in `ELSEWHERE`, which says where each is run or why it is not
(another project's tool, or hardware this machine lacks). The README's tour runs whole in
tests/test_tour.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"```bash\n(.*?)```", re.S)
SEPARATORS = {"&&", "||", ";", "&", "|"}
PYTHONS = {"python", "python3", "python3.11", ".venv/bin/python"}
ELSEWHERE = {  # program -> where it is checked, or why not here
    "bash": "scripts/install.sh: .ci/run runs its cpu route on a fresh machine and resolves the "
    "cuda and tpu routes against PyPI (scripts/check_installs.py)",
    "source": "the shell's: tests/test_tour.py runs it",
    "curl": "tests/test_tour.py sends the tour's request",
    "until": "the shell's: tests/test_tour.py runs the tour's wait",
    "kill": "the shell's: tests/test_tour.py stops the tour's server with it",
    "sleep": "the shell's",
    "mkdocs": ".ci/run builds the manual with --strict",
    "ruff": ".ci/run runs both checks",
    "lm-eval": "lm-eval's own command line: tests/test_lm_eval.py runs its hf route",
    "tensorboard": "a viewer, not a dependency (docs/training.md)",
    "pip": "the Neuron plugin's install: its package repository and a Trainium instance",
    "vllm": "vLLM's own command line: tests/test_vllm_serve.py serves an export with it",
}
OTHER_MODULES = {  # python -m of another project
    "pytest": "the test command itself: .ci/run runs it",
}


def commands(text: str) -> list[list[str]]:
    """The commands of a page's bash blocks, each as its words: continuations joined, comments,
    redirections and heredoc bodies dropped, split at `&&`, `;`, `&` and `|`."""
    out = []
    for block in FENCE.findall(text):
        block = block.replace("\\\n", " ")
        heredoc = None
        for line in block.splitlines():
            if heredoc:
                heredoc = None if line.strip() == heredoc else heredoc
                continue
            if m := re.search(r"<<-?'?(\w+)'?", line):
                heredoc = m.group(1)
            words = [w for w in shlex.split(line, comments=True) if not re.match(r"^\d*[<>]", w)]
            current = []
            for word in [*words, ";"]:
                if word in SEPARATORS:
                    out += [current] if current else []
                    current = []
                else:
                    current.append(word)
    return out


def program(words: list[str]) -> list[str]:
    """The words without leading `NAME=value` environment settings and shell keywords."""
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] in ("do", "done")):
        words = words[1:]
    return words


ALL = [(page, cmd) for page in PAGES for cmd in map(program, commands((REPO / page).read_text()))]
ALL = [(page, cmd) for page, cmd in ALL if cmd]


def test_every_page_shows_commands_and_the_extraction_reads_them():
    assert len(ALL) > 50
    assert ["kill", "-INT", "$!"] in [cmd for _, cmd in ALL]  # `&` and comments split off
    tour = [cmd for page, cmd in ALL if page == "README.md" and cmd[0] == "python"]
    assert ["python", "-"] in tour  # the heredoc's body is not read as commands


def test_every_program_is_ours_or_accounted_for():
    unknown = {
        (page, cmd[0])
        for page, cmd in ALL
        if cmd[0] not in PYTHONS and cmd[0] not in ELSEWHERE and cmd[0] != "XLA_FLAGS"
    }
    assert not unknown, f"programs no test checks (add them to ELSEWHERE, saying where): {unknown}"


def python_modules() -> list[tuple[str, str, list[str]]]:
    out = []
    for page, cmd in ALL:
        if cmd[0] in PYTHONS and cmd[1:2] == ["-m"] and cmd[2] not in OTHER_MODULES:
            out.append((page, cmd[2], cmd[3:]))
    return out


MODULE_COMMANDS = python_modules()


BAD = ("train.eval", ["--checkpoint", "runs/x", "--task", "ppl", "--no-such-flag"])


@pytest.fixture(scope="module")
def parsed() -> dict[tuple[str, str], str]:
    """Every page command parsed in one process of its own (tests/doc_commands.py), and BAD:
    {(module, args joined): "" or what went wrong}."""
    commands = [(m, a) for _, m, a in MODULE_COMMANDS] + [BAD]
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "doc_commands.py")],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {(m, shlex.join(a)): r for (m, a), r in zip(commands, results, strict=True)}


@pytest.mark.parametrize(
    ("page", "module", "args"),
    MODULE_COMMANDS,
    ids=[f"{p}:{m} {' '.join(a)}"[:90] for p, m, a in MODULE_COMMANDS],
)
def test_the_command_parses(parsed, page, module, args):
    """`python -m MODULE ARGS` as the page shows it: parsed by the module's own parser."""
    problem = parsed[(module, shlex.join(args))]
    assert problem == "", f"{page}: python -m {module} {shlex.join(args)}: {problem}"


def test_a_flag_the_module_lacks_fails(parsed):
    assert "unrecognized arguments: --no-such-flag" in parsed[(BAD[0], shlex.join(BAD[1]))]


def test_the_3b_training_line_is_the_planned_recipe():
    """docs/training.md's 3B command sets every setting of the recipe bench.plan compiles
    (bench/results/plan.json) but the Neuron launcher's own: before, it lacked eot_id=50256, so
    on the published FineWeb shards (no meta.json) its document resets turned themselves off."""
    from train.plan import with_launch_settings

    recipe = json.loads((REPO / "bench" / "results" / "plan.json").read_text())["recipe_overrides"]
    launcher = set(with_launch_settings([]))
    lines = [
        cmd
        for page, cmd in ALL
        if page == "docs/training.md" and cmd[:4] == ["python", "-m", "train.main", "--config"]
        and cmd[4] == "laplace-3b"
    ]  # fmt: skip
    assert len(lines) == 1
    assert {s for s in recipe if s not in launcher} <= set(lines[0])
    assert "eot_id=50256" in lines[0]
