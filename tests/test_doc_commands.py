"""Every command the README and the manual show (each line of their ```bash blocks) names a
module and flags that exist: each `python -m MODULE ARGS` has ARGS parsed by MODULE's own parser,
run as `python -m` runs it (its `__main__`), stopped once they parse; `--help` prints its help;
the commands of `RUN` run whole, in seconds. Other programs must be in `ELSEWHERE`, which says
where each is run or why it is not (another project's tool, or hardware this machine lacks). The
README's tour runs whole in tests/test_tour.py."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"```bash\n(.*?)```", re.S)
SEPARATORS = {"&&", "||", ";", "&", "|"}
PYTHONS = {"python", "python3", "python3.11", ".venv/bin/python"}
ELSEWHERE = {  # program -> where it is checked, or why not here
    "bash": "scripts/install.sh: .ci/run runs it on a fresh machine",
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
}
OTHER_MODULES = {  # python -m of another project
    "venv": "Python's own: the CUDA install (docs/index.md), not run without a GPU",
    "pip": "pip's own: the CUDA install (docs/index.md), not run without a GPU",
    "pytest": "the test command itself: .ci/run runs it",
}
RUN = {"laplace_jax.info"}  # runs whole in seconds


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


class Parsed(Exception):
    """Raised by the patched parser once a module's arguments have parsed."""


def stop_after(name: str):
    """`ArgumentParser.<name>`, raising `Parsed` once the arguments parse (a bad flag: argparse's
    own error, SystemExit(2))."""
    parse = getattr(argparse.ArgumentParser, name)

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    return parse_then_stop


MAIN_NAMESPACES: dict[str, dict] = {}  # a module run once: its namespace, main() run again


def run_as_main(module: str) -> None:
    """Execute `module`'s source (a package's `__main__`) as `python -m` does, under the name
    `__main__`; read from its file, since pytest's import hook cannot hand runpy the code of a
    module named like a test (bench/test_suite.py). A module run before runs its `main()` again
    (with sys.argv), not its source, which may register names once per process (serve.lm_eval's
    model with lm-eval)."""
    if "main" in MAIN_NAMESPACES.get(module, {}):
        MAIN_NAMESPACES[module]["main"]()
        return
    spec = importlib.util.find_spec(module)
    if spec.submodule_search_locations is not None:  # a package: its __main__
        spec = importlib.util.find_spec(f"{module}.__main__")
    path = Path(spec.origin)
    code = compile(path.read_text(), str(path), "exec")
    namespace = {"__name__": "__main__", "__file__": str(path), "__package__": spec.parent}
    MAIN_NAMESPACES[module] = namespace
    exec(code, namespace)


def python_modules() -> list[tuple[str, str, list[str]]]:
    out = []
    for page, cmd in ALL:
        if cmd[0] in PYTHONS and cmd[1:2] == ["-m"] and cmd[2] not in OTHER_MODULES:
            out.append((page, cmd[2], cmd[3:]))
    return out


MODULE_COMMANDS = python_modules()


@pytest.mark.parametrize(
    ("page", "module", "args"),
    MODULE_COMMANDS,
    ids=[f"{p}:{m} {' '.join(a)}"[:90] for p, m, a in MODULE_COMMANDS],
)
def test_the_command_parses(page, module, args, monkeypatch, capsys):
    """`python -m MODULE ARGS` as the page shows it: parsed by the module's own parser."""
    if module not in RUN:  # argparse's two entry points (train.main's parser intermixes)
        for name in ("parse_args", "parse_intermixed_args"):
            monkeypatch.setattr(argparse.ArgumentParser, name, stop_after(name))
    monkeypatch.setattr(sys, "argv", [module, *args])
    try:
        run_as_main(module)
    except Parsed:
        assert module not in RUN
    except SystemExit as e:
        out = capsys.readouterr()
        assert e.code in (0, None), f"{page}: python -m {module} {shlex.join(args)}:\n{out.err}"
        assert module in RUN or "--help" in args, f"{module} exited before parsing its flags"
    else:
        assert module in RUN, f"{module} never parsed its flags with argparse"
    if module == "train.neuron" and "--" in args:  # the launcher passes the rest to train.main
        from train import cli

        with pytest.raises(Parsed):
            cli.parse_args(args[args.index("--") + 1 :])


def test_a_flag_the_module_lacks_fails(monkeypatch, capsys):
    with pytest.raises(AssertionError, match="unrecognized arguments: --no-such-flag"):
        args = ["--checkpoint", "runs/x", "--task", "ppl", "--no-such-flag"]
        test_the_command_parses("a page", "train.eval", args, monkeypatch, capsys)
