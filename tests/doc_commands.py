"""Parse page commands with their modules' own parsers, in a process of their own.

    python tests/doc_commands.py < commands.json     # [[module, [args...]], ...] -> JSON list

For each `python -m MODULE ARGS` (tests/test_doc_commands.py collects them from the pages) it
runs MODULE as `python -m` would (its `__main__`), with argparse's entry points patched to stop
once the arguments parse; a module of `RUN` runs whole. It prints one result per command: "" when
the command parses (or runs and exits 0), else what went wrong. Its own process, because running
a module's `__main__` leaves state behind (lm-eval's model registry, vLLM's patched torch
settings) that the tests which come after must not see.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

RUN = {"laplace_jax.info"}  # runs whole in seconds
MAIN_NAMESPACES: dict[str, dict] = {}  # a module run once: its namespace, main() run again


class Parsed(Exception):
    """Raised by the patched parser once a module's arguments have parsed."""


def stop_after(parse):
    """`parse` (an ArgumentParser method), raising `Parsed` once the arguments parse (a bad flag:
    argparse's own error, SystemExit(2))."""

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    return parse_then_stop


def run_as_main(module: str) -> None:
    """Execute `module`'s source (a package's `__main__`) as `python -m` does, under the name
    `__main__`. A module run before runs its `main()` again (with sys.argv), not its source,
    which may register names once per process (serve.lm_eval's model with lm-eval)."""
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


def check(module: str, args: list[str]) -> str:
    """ "" when `python -m MODULE ARGS` parses (a RUN module: runs and exits 0), else why not."""
    names = ("parse_args", "parse_intermixed_args")  # train.main's parser intermixes
    originals = {n: getattr(argparse.ArgumentParser, n) for n in names}
    if module not in RUN:
        for n in names:
            setattr(argparse.ArgumentParser, n, stop_after(originals[n]))
    sys.argv = [module, *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            run_as_main(module)
        outcome = "" if module in RUN else "never parsed its flags with argparse"
    except Parsed:
        outcome = "parsed, but was meant to run whole" if module in RUN else ""
    except SystemExit as e:
        if e.code not in (0, None):
            outcome = f"exit status {e.code}: {err.getvalue()[-2000:]}"
        elif module not in RUN and "--help" not in args:
            outcome = "exited before parsing its flags"
        else:
            outcome = ""
    except Exception as e:  # noqa: BLE001  the command is broken: say how
        outcome = f"{type(e).__name__}: {e}"
    finally:
        for n, f in originals.items():
            setattr(argparse.ArgumentParser, n, f)
    if not outcome and module == "train.neuron" and "--" in args:  # the rest goes to train.main
        outcome = _check_train_args(args[args.index("--") + 1 :])
    return outcome


def _check_train_args(train_args: list[str]) -> str:
    """The arguments `train.neuron launch -- ...` hands to train.main, parsed by its parser."""
    from train import cli

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cli.parse_args(train_args)
    except SystemExit as e:
        return f"train.main's part: exit status {e.code}: {err.getvalue()[-2000:]}"
    return ""


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    commands = json.load(sys.stdin)
    results = [check(module, args) for module, args in commands]
    sys.stdout = sys.__stdout__
    print(json.dumps(results))
