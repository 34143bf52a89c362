"""Serving defaults per platform (serve/vllm_adapter.py): the argument vector vLLM's server gets
for the same flags on a CPU and on a GPU, and what the export's vllm_serve.yaml sets on both."""

from __future__ import annotations

import os

import pytest

from serve import vllm_adapter


def _argv(folder, platform, *flags):
    args = vllm_adapter.parser().parse_args(["--model", str(folder), *flags])
    return vllm_adapter.server_argv(vllm_adapter.settle(args, platform), platform)


def _value(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_each_platform_gets_its_own_defaults(tiny_export):
    """CPU: eager, max_num_seqs from the state page budget; CUDA: vLLM's own (compiled with CUDA
    graphs, its max_num_seqs and memory sizing). Before, the CPU's were given everywhere."""
    folder = tiny_export[2]
    cpu, cuda = _argv(folder, "cpu"), _argv(folder, "cuda")
    assert "--enforce-eager" in cpu and "--enforce-eager" not in cuda
    assert _value(cpu, "--max-num-seqs") == str(vllm_adapter.default_max_num_seqs(folder))
    assert "--max-num-seqs" not in cuda and "--gpu-memory-utilization" not in cuda
    assert "--enforce-eager" in _argv(folder, "cuda", "--eager")
    assert "--enforce-eager" not in _argv(folder, "cpu", "--compile")
    assert _value(_argv(folder, "cuda", "--max-num-seqs", "64"), "--max-num-seqs") == "64"
    for argv in (cpu, cuda):  # the export's own settings (vllm_serve.yaml), on both
        assert _value(argv, "--dtype") == "float32" and "--no-enable-prefix-caching" in argv
    offline = vllm_adapter.engine_kwargs(folder, platform="cuda")
    assert not offline["enforce_eager"] and "max_num_seqs" not in offline
    assert vllm_adapter.engine_kwargs(folder, platform="cpu")["enforce_eager"]


def test_replicas_bind_cpu_cores_only_on_the_cpu(tiny_export, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    folder = str(tiny_export[2])
    parse = vllm_adapter.parser().parse_args
    cpu = vllm_adapter.settle(parse(["--model", folder, "-dp", "2"]), "cpu")
    assert cpu.replica_bind is not None and "|" in cpu.replica_bind
    cuda = vllm_adapter.settle(parse(["--model", folder, "-dp", "2"]), "cuda")
    assert cuda.replica_bind is None and cuda.data_parallel_size == 2
    with pytest.raises(ValueError, match="bind CPU cores: on a GPU, drop them"):
        vllm_adapter.settle(parse(["--model", folder, "-dp", "2", "--bind", "0|1"]), "cuda")


def test_the_cpu_environment_is_set_on_the_cpu_only(monkeypatch):
    for key in vllm_adapter.ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    vllm_adapter.set_env_defaults("cuda")
    assert not any(key in os.environ for key in vllm_adapter.ENV_DEFAULTS)
    vllm_adapter.set_env_defaults("cpu")
    assert {k: os.environ[k] for k in vllm_adapter.ENV_DEFAULTS} == vllm_adapter.ENV_DEFAULTS


def test_the_state_store_is_refused_off_the_cpu(tiny_export, tmp_path):
    """--state-dir copies the engine's state pages as host memory: on a GPU it stops at start,
    naming the flag to use, instead of sizing a CPU store for a GPU engine."""
    args = vllm_adapter.parser().parse_args(
        ["--model", str(tiny_export[2]), "--state-dir", str(tmp_path / "states")]
    )
    with pytest.raises(ValueError, match="--state-dir runs on vLLM's CPU backend"):
        vllm_adapter.settle(args, "cuda")


def test_the_adapter_follows_the_exports_vllm_serve_yaml(tiny_export, tmp_path):
    """vllm_serve.yaml is the one source of the engine settings both routes read: changed, the
    adapter's argument vector follows it, on both platforms."""
    import shutil

    folder = tmp_path / "export"
    shutil.copytree(tiny_export[2], folder)
    settings = folder / "vllm_serve.yaml"
    text = settings.read_text()
    assert "dtype: float32" in text and "enable-prefix-caching: false" in text
    text = text.replace("dtype: float32", "dtype: bfloat16")
    settings.write_text(text.replace("enable-prefix-caching: false", "enable-prefix-caching: true"))
    for platform in ("cpu", "cuda"):
        argv = _argv(folder, platform)
        assert _value(argv, "--dtype") == "bfloat16"
        assert "--enable-prefix-caching" in argv and _value(argv, "--mamba-cache-mode") == "align"


def test_vllms_own_page_size_flag_is_the_budget(tiny_export, monkeypatch):
    """vLLM's --kv-cache-memory-bytes through --vllm-arg sizes the pages: the CPU's sequences
    are counted from it, and the adapter does not set VLLM_CPU_KVCACHE_SPACE, which vLLM's CPU
    backend would let override it; with that variable set as well it stops, naming both."""
    folder = tiny_export[2]
    monkeypatch.delenv(vllm_adapter.KV_SPACE_ENV, raising=False)
    budget = 1 << 20  # 1 MiB: fewer sequences than the 1 GiB default's cap of 2048
    argv = _argv(folder, "cpu", f"--vllm-arg=--kv-cache-memory-bytes={budget}")
    assert _value(argv, "--max-num-seqs") == str(vllm_adapter.default_max_num_seqs(folder, budget))
    assert _value(argv, "--max-num-seqs") != str(vllm_adapter.default_max_num_seqs(folder))
    vllm_adapter.set_env_defaults("cpu", pages_sized=True)
    assert vllm_adapter.KV_SPACE_ENV not in os.environ
    monkeypatch.setenv(vllm_adapter.KV_SPACE_ENV, "1")
    with pytest.raises(ValueError, match="both size the state pages"):
        _argv(folder, "cpu", "--vllm-arg=--kv-cache-memory-bytes=64M")
