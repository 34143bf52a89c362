"""The Neuron launcher and settings (train/neuron.py, train/neuron_smoke.py): the environment of
each process for 1, 2 and 4 instances (values worked out by hand), argument errors naming the
field, the launcher's --dry-run, host initialisation equal to the on-device one bit for bit, and
the smoke script on 2 simulated CPU devices. Nothing here touches Neuron hardware."""

import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest
from shared_fixtures import START_ENV

from laplace_jax.model import abstract_params
from laplace_jax.sharding import abstract_with_shardings, make_mesh, param_shardings, replicated
from laplace_spec.config import ConfigError
from train import build, neuron
from train import config as train_config
from train.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parent.parent
FLAGS = "--auto-cast=none --native-int64=enabled --implicit-integer-downcast=none"


def test_one_instance_one_process_owns_all_64_cores():
    env = neuron.neuron_env(1, 0, cache_dir="/cache")
    assert env == {
        "NEURON_LOGICAL_NC_CONFIG": "2",
        "NEURON_RT_VISIBLE_CORES": "0-63",
        "NEURON_PJRT_PROCESSES_NUM_DEVICES": "64",
        "NEURON_PJRT_PROCESS_INDEX": "0",
        "NEURON_COMPILE_CACHE_URL": "/cache",
        "JAX_COMPILATION_CACHE_DIR": "/cache/jax",
        "NEURON_CC_FLAGS": FLAGS,
    }  # a single process: no coordinator, no JAX distributed variables


def test_two_instances():
    envs = [neuron.neuron_env(2, i, coordinator="10.0.0.1:41000") for i in range(2)]
    for i, env in enumerate(envs):
        assert env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "64,64"
        assert env["NEURON_PJRT_PROCESS_INDEX"] == env["JAX_PROCESS_ID"] == str(i)
        assert env["NEURON_RT_VISIBLE_CORES"] == "0-63"  # each instance uses its own 64
        assert env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.1:41000"
        assert env["NEURON_RT_ROOT_COMM_ID"] == "10.0.0.1:41001"  # the next port
        assert env["JAX_NUM_PROCESSES"] == "2"
        assert env["NEURON_COMPILE_CACHE_URL"] == neuron.DEFAULT_CACHE_DIR
        assert env["NEURON_CC_FLAGS"] == FLAGS


def test_four_instances_at_lnc1_and_split_processes():
    env = neuron.neuron_env(
        4, 3, coordinator="head:5000", cores_per_instance=128, logical_nc=1, cc_flags=["-O1"]
    )
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert env["NEURON_RT_VISIBLE_CORES"] == "0-127"
    assert env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "128,128,128,128"
    assert env["NEURON_PJRT_PROCESS_INDEX"] == "3" and env["JAX_NUM_PROCESSES"] == "4"
    assert env["NEURON_CC_FLAGS"] == "-O1"
    # 4 instances x 2 processes of 32 cores: instance 2's second process is process 5, on 32-63
    env = neuron.neuron_env(
        4,
        2,
        coordinator="head:5000",
        processes_per_instance=2,
        local_rank=1,
        rt_root_comm="head:6000",
    )
    assert env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "32,32,32,32,32,32,32,32"
    assert env["NEURON_PJRT_PROCESS_INDEX"] == env["JAX_PROCESS_ID"] == "5"
    assert env["NEURON_RT_VISIBLE_CORES"] == "32-63"
    assert env["JAX_NUM_PROCESSES"] == "8"
    assert env["NEURON_RT_ROOT_COMM_ID"] == "head:6000"
    # one core per process: a single index, not a range
    env = neuron.neuron_env(
        1, 0, coordinator="h:1", cores_per_instance=2, processes_per_instance=2, local_rank=1
    )
    assert env["NEURON_RT_VISIBLE_CORES"] == "1"
    assert env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "1,1"


@pytest.mark.parametrize(
    "args,kwargs,field",
    [
        ((0, 0), {}, "n_instances"),
        ((2, 2), {"coordinator": "h:1"}, "instance_index"),
        ((2, -1), {"coordinator": "h:1"}, "instance_index"),
        ((1, 0), {"logical_nc": 4}, "logical_nc"),
        ((1, 0), {"cores_per_instance": 0}, "cores_per_instance"),
        ((1, 0), {"processes_per_instance": 3}, "processes_per_instance"),
        (
            (1, 0),
            {"processes_per_instance": 2, "local_rank": 2, "coordinator": "h:1"},
            "local_rank",
        ),
        ((2, 0), {}, "coordinator"),
        ((2, 0), {"coordinator": "no-port"}, "coordinator"),
        ((2, 0), {"coordinator": "h:65535"}, "coordinator"),
        ((1, 0), {"cache_dir": ""}, "cache_dir"),
        ((1, 0), {"cc_flags": "--auto-cast=none"}, "cc_flags"),
        ((2, 0), {"coordinator": "h:1", "rt_root_comm": "h"}, "rt_root_comm"),
    ],
)
def test_bad_arguments_name_the_field(args, kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        neuron.neuron_env(*args, **kwargs)


def test_launcher_dry_run_prints_the_environment_and_the_command(capsys):
    launcher = ["launch", "--instances", "2", "--index", "1", "--coordinator", "10.0.0.1:41000"]
    user = ["--config", "laplace-3b", "micro_batch_size=64", "scan_unroll=false"]
    argv = [*launcher, "--dry-run", "--", *user]
    assert neuron.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    exports = dict(
        line.removeprefix("export ").split("  #")[0].split("=", 1) for line in lines[:-1]
    )
    assert exports["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "64,64"
    assert exports["NEURON_PJRT_PROCESS_INDEX"] == exports["JAX_PROCESS_ID"] == "1"
    assert exports["NEURON_CC_FLAGS"] == f"'{FLAGS}'"  # shell-quoted
    command = lines[-1].split()
    assert command[1:3] == ["-m", "train.main"]
    # the user's arguments, then what the launcher adds (peak: 128 x 166.75 TFLOP/s)
    assert command[3:] == [*user, "init_on_host=true", "peak_flops=2.1344e+16"]
    # with --mesh, the peak counts the mesh's devices; a user's peak_flops is kept
    assert neuron.train_settings(["--mesh", "data=2,fsdp=16"], 128, 2) == [
        "scan_unroll=true",
        "init_on_host=true",
        "peak_flops=5.336e+15",
    ]
    assert neuron.train_settings(["train.peak_flops=1e15"], 64, 1) == [
        "scan_unroll=true",
        "init_on_host=true",
    ]
    # --mesh is read by train.main's own parser: a bad one is train.main's error
    with pytest.raises(ConfigError, match="^--mesh needs fsdp=F"):
        neuron.train_settings(["--mesh", "data=2"], 128, 2)


def test_launcher_rejects_bad_arguments(capsys):
    assert neuron.main(["launch", "--instances", "2", "--dry-run", "--", "--config", "tiny"]) == 2
    assert "coordinator" in capsys.readouterr().err


def _init_parts(cfg, mesh):
    """What restore_or_init needs of train.build.build_model, without compiling the steps."""
    ps = param_shardings(cfg.model, mesh)
    abs_params = abstract_with_shardings(abstract_params(cfg.model), ps)
    tx, _, os_ = train_config.build_optimizer(cfg.optim, abs_params, ps, mesh)
    abs_opt = abstract_with_shardings(jax.eval_shape(tx.init, abs_params), os_)
    return {
        "tx": tx,
        "p_shard": ps,
        "o_shard": os_,
        "abs_params": abs_params,
        "abs_opt": abs_opt,
        "state_shard": {"bad_streak": replicated(mesh)},
    }


def test_init_on_host_equals_the_device_init_bit_for_bit():
    """A new run's state (train.build.restore_or_init with no checkpoint) on 8 devices, tiny
    preset, seed 3: parameters initialised on the host CPU and placed equal the jitted on-device
    init bit for bit, with the same shardings; the optimizer state too."""
    mesh = make_mesh(8)
    states = {}
    for flag in ("false", "true"):
        cfg = train_config.resolve("tiny", [f"init_on_host={flag}", "seed=3"], {})
        with tempfile.TemporaryDirectory() as d:
            ckpt = Checkpointer(d, async_save=False)
            states[flag], start, _ = build.restore_or_init(cfg, _init_parts(cfg, mesh), ckpt, None)
            ckpt.close()
        assert start == 0
    device, host = states["false"], states["true"]
    pairs = list(zip(jax.tree.leaves(device), jax.tree.leaves(host), strict=True))
    assert len(pairs) > 20
    for a, b in pairs:
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    w = host["params"]["layer_0"]["w12"]["kernel"]
    assert len(w.sharding.device_set) == 8 and w.addressable_shards[0].data.shape[0] < w.shape[0]


def _smoke(*args, timeout=300):
    # a fresh command (START_ENV: not vLLM's LD_PRELOAD); the script sets its own device count
    env = dict(START_ENV)
    return subprocess.run(
        [sys.executable, "-m", "train.neuron_smoke", "--backend", "cpu", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_smoke_script_passes_on_two_cpu_devices():
    out = _smoke("--cores", "2")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for check in ("processes", "muon", "step", "checkpoint"):
        assert any(line.startswith(f"PASS {check}:") for line in lines), out.stdout
    assert "process 0 of 2: 1 of 2 devices, sum 3 (expected 3)" in out.stdout
    assert "process 1 of 2: 1 of 2 devices" in out.stdout
    assert "AdamW leaves bit-identical: yes" in out.stdout
    assert lines[-1] == "4 of 4 checks passed"


def test_smoke_script_fails_loudly():
    out = _smoke("--cores", "2", "--checks", "processes", "--timeout", "0.01")
    assert out.returncode == 1
    assert "FAIL processes: no answer within" in out.stdout
    assert out.stdout.splitlines()[-1] == "0 of 1 checks passed; FAILED"
