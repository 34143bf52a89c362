"""`python -m train.plan` and the compiled-program reader under it (laplace_jax/hlo.py), checked
on programs whose collectives and constructs are known by construction, then on the trainer's
own programs (tiny and small presets, 8 simulated devices)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from laplace_jax import hlo
from laplace_jax.sharding import FSDP, make_mesh
from laplace_spec import names
from laplace_spec.config import get_config
from train import plan as train_plan

DESIGN_PLAN_KEYS = {  # docs/design.md s7
    "train_step_gib_per_device",
    "train_step_fits_24gib",
    "collective_bytes_over_fsdp_ideal",
    "neuron_census_violations",
    "modelled_trn2_step_s",
    "train_flops_per_step",
}
PLAN_KEYS = DESIGN_PLAN_KEYS | {"train_step_fits_16gib"}  # issue 8's margin


def _compiled_text(fn, *args, **jit_kwargs) -> str:
    return jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()


def test_collectives_are_counted_per_loop_trip():
    """An all_gather inside a 3-step scan and a psum_scatter after it, on 8 devices: the reader
    finds 3 executions of the gather and the bytes a ring moves into one device."""
    mesh = make_mesh(8)
    spec = PartitionSpec(FSDP)

    def body(x):  # x: this device's [4, 16] rows of a [32, 16] f32 array
        def step(carry, _):
            full = jax.lax.all_gather(carry, FSDP, tiled=True)  # [32, 16]
            return carry + full[:4] * 0.5, None

        x, _ = jax.lax.scan(step, x, None, length=3)
        return jax.lax.psum_scatter(jnp.tile(x, (8, 1)), FSDP, tiled=True)  # [32, 16] -> [4, 16]

    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    x = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, spec))
    got = hlo.collective_bytes(hlo.collectives(_compiled_text(fn, x), 8), False)
    full = 32 * 16 * 4
    assert got["all-gather"] == 3 * full * 7 // 8  # 7/8 of the gathered array, three times
    assert got["reduce-scatter"] + got["all-reduce"] > 0
    if got["reduce-scatter"]:  # [32, 16] in, [4, 16] out: 7 of 8 pieces arrive
        assert got["reduce-scatter"] == full * 7 // 8


def test_an_all_reduce_kept_only_as_a_slice_counts_as_a_reduce_scatter():
    """The FSDP gradient of a row-sharded matrix: XLA:CPU all-reduces the whole gradient and
    slices this device's rows; counted as compiled (all-reduce, 2 x 7/8 of it) and as the
    reduce-scatter GPU/TPU/Neuron form from it (7/8)."""
    mesh = make_mesh(8)
    w = jax.ShapeDtypeStruct(
        (64, 32), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(FSDP))
    )
    x = jax.ShapeDtypeStruct(
        (16, 64), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(FSDP))
    )
    grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    text = _compiled_text(grad, w, x, out_shardings=w.sharding)
    colls = hlo.collectives(text, 8)
    here = hlo.collective_bytes(colls, target_forms_reduce_scatter=False)
    target = hlo.collective_bytes(colls)
    gradient = 64 * 32 * 4
    if here["reduce-scatter"]:  # a backend that forms it itself
        assert here["reduce-scatter"] == gradient * 7 // 8
    else:
        assert any(c["sliced"] for c in colls)
        assert here["all-reduce"] >= 2 * gradient * 7 // 8
        assert target["reduce-scatter"] == gradient * 7 // 8


def test_census_flags_what_neuron_rejects_and_passes_a_clean_program():
    x = jnp.ones((8,), jnp.float32)
    clean = hlo.neuron_census(_compiled_text(lambda x: jnp.tanh(x) * 2, x))
    assert clean["violations"] == 0
    cond = hlo.neuron_census(
        _compiled_text(lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x), x)
    )
    assert cond["conditionals"] >= 1
    argmax = hlo.neuron_census(_compiled_text(lambda x: jnp.argmax(x), x))
    assert argmax["variadic_reductions"] >= 1
    loop = hlo.neuron_census(
        _compiled_text(lambda x: jax.lax.while_loop(lambda c: c[0] < 100, lambda c: c * 2, x), x)
    )
    assert loop["while_loops_without_static_trip_count"] == 1
    callback = hlo.neuron_census(
        _compiled_text(
            lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct((8,), x.dtype), x), x
        )
    )
    assert callback["host_callbacks"] >= 1 and callback["violations"] >= 1
    fixed = hlo.neuron_census(
        _compiled_text(lambda x: jax.lax.fori_loop(0, 5, lambda i, c: jnp.sin(c) + c, x), x)
    )
    assert fixed["while_loops_without_static_trip_count"] == 0


@pytest.fixture(scope="module")
def tiny_plan():
    cfg = train_plan_resolve("tiny", ["global_batch_tokens=1024", "micro_batch_size=8"])
    return train_plan.make_plan(cfg, make_mesh(8))


def train_plan_resolve(preset, overrides):
    from train import config as train_config

    return train_config.resolve(preset, overrides, {})


def test_plan_of_the_tiny_trainer(tiny_plan):
    plan = tiny_plan
    assert set(plan["headline"]) == PLAN_KEYS
    assert plan["batch"] == {
        "sequences": 16,
        "accum_steps": 2,
        "micro_batch": 8,
        "tokens": 1024,
        "tokens_per_device": 64,
    }
    # parameters counted from the name table's shapes (not the accounting under test)
    P = sum(math.prod(e.jax_shape) for e in names.table(get_config("tiny")))
    assert plan["parameters"] == P
    assert plan["headline"]["train_flops_per_step"] == 6 * P * 1024
    assert set(plan["programs"]) == {
        "init_params",
        "init_optimizer",
        "train_step",
        "eval_step",
        "generate_prefill",
        "generate_decode",
    }
    step = plan["programs"]["train_step"]
    # the step's arguments hold at least this device's share of params and optimizer state
    assert step["memory"]["arguments"] >= 4 * P // 8
    assert step["memory"]["fits"] and plan["headline"]["train_step_fits_24gib"] == 1
    # every program but the threefry init (64-bit counters: Neuron runs use rbg) is Neuron-clean
    for name in (
        "init_optimizer",
        "train_step",
        "eval_step",
        "generate_prefill",
        "generate_decode",
    ):
        assert plan["programs"][name]["census"]["violations"] == 0, name
    # the accumulation loop runs twice: a static trip count the census records
    assert 2 in step["census"]["while_trip_counts"]
    # FSDP ideal: tiny computes in fp32, so weights are gathered in fp32 twice (2 x 4 bytes) and
    # gradients reduce-scattered in fp32 (4): 12 P 7/8 per micro-step, twice, plus Muon's a2a
    ideal = plan["fsdp_ideal_bytes_received"]
    assert ideal["fsdp_per_micro_step"] == 12 * P * 7 // 8
    assert ideal["data_parallel"] == 0  # a 1-D mesh
    assert ideal["context_exchange_per_micro_step"] == 0  # no context axis
    assert ideal["total"] == 2 * ideal["fsdp_per_micro_step"] + ideal["muon_a2a"]
    assert step["collectives"]["all-to-all"] == ideal["muon_a2a"]  # Muon's two all_to_alls
    assert step["collectives"]["total"] > 0


def test_plan_cli_prints_json_with_the_headline(capsys):
    status = train_plan.main(
        ["--config", "tiny", "global_batch_tokens=512", "--json", "--hbm-gib", "16"]
    )
    assert status == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan["headline"]) == PLAN_KEYS and plan["hbm_gib"] == 16.0
    assert plan["mesh"] == {FSDP: 8}
    assert train_plan.main(["--config", "tiny", "bogus=1"]) == 2


def test_greedy_token_is_argmax_without_a_variadic_reduce():
    from laplace_jax.generate import greedy_token

    rng = np.random.default_rng(0)
    logits = rng.integers(-3, 4, (64, 50)).astype(np.float32)  # many ties: the first must win
    logits[5] = 2.0  # all equal
    assert np.array_equal(greedy_token(jnp.asarray(logits)), np.argmax(logits, -1))
    census = hlo.neuron_census(_compiled_text(greedy_token, jnp.asarray(logits)))
    assert census["variadic_reductions"] == 0 and census["violations"] == 0


def test_plan_on_a_2d_mesh():
    """data=2 x fsdp=4: FSDP groups of 4 (gathers of 3/4), the gradient shard all-reduced
    across the 2 data rows, the batch over all 8 devices."""
    cfg = train_plan_resolve("tiny", ["global_batch_tokens=512"])
    from train.cli import mesh_from_flag

    plan = train_plan.make_plan(cfg, mesh_from_flag("data=2,fsdp=4"))
    assert plan["mesh"] == {"data": 2, FSDP: 4}
    P = plan["parameters"]
    ideal = plan["fsdp_ideal_bytes_received"]
    assert ideal["fsdp_per_micro_step"] == 12 * P * 3 // 4  # fp32
    assert ideal["data_parallel"] == 2 * (4 * P // 4) // 2
    step = plan["programs"]["train_step"]
    assert step["census"]["violations"] == 0 and step["collectives"]["total"] > 0


def test_replica_group_sizes_in_every_hlo_format():
    """The three ways XLA writes replica groups (lines as XLA:CPU prints them for a 2 x 4 mesh)."""
    mesh_form = (
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
        "{'axis_0'}, dimensions={0}"
    )
    assert hlo._group_size(mesh_form, 8) == 4
    assert hlo._group_size("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, x", 8) == 8
    assert hlo._group_size("replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}", 8) == 2
    assert hlo._group_size("replica_groups=[2,4]<=[8], dimensions={0}", 8) == 4


@pytest.mark.parametrize("unroll", [True, False])
def test_small_preset_programs_are_neuron_clean_and_unroll_leaves_no_chunk_loop(unroll):
    """docs/design.md s1 on every program the trainer compiles for `small` on 8 devices, with 2
    accumulation steps and per-layer remat: no conditionals, callbacks, variadic reductions, f64
    or data-dependent loops; with scan_unroll the chunk scan leaves no loop, only loops of
    static trip counts: the accumulation's (2) and the layer scan's (4 layers, forward and
    backward). Parameter init is the exception: threefry keeps 64-bit counters (Neuron runs use
    rbg and initialise on the host)."""
    overrides = [
        "global_batch_tokens=8192",
        "micro_batch_size=8",
        f"scan_unroll={unroll}",
        "remat=layer",
    ]
    plan = train_plan.make_plan(train_plan_resolve("small", overrides), make_mesh(8))
    for name, program in plan["programs"].items():
        if name != "init_params":
            assert program["census"]["violations"] == 0, (name, program["census"])
    loops = plan["programs"]["train_step"]["census"]["while_trip_counts"]
    small = get_config("small")
    chunks = small.n_chunks  # 8 chunks of 64 at seq_len 512
    assert chunks != small.n_layers
    if unroll:
        assert set(loops) == {2, small.n_layers}
    else:
        assert {2, small.n_layers, chunks} <= set(loops)


def test_a_bf16_gather_that_xla_cpu_widens_counts_at_bf16_width():
    """XLA:CPU has no bf16 collectives: it gathers bf16 data as f32 between two converts. The
    reader counts the bf16 bytes a GPU/TPU/Neuron moves, and the f32 bytes as compiled here."""
    mesh = make_mesh(8)
    spec = PartitionSpec(FSDP)

    def body(x):  # [4, 16] f32 rows -> gathered in bf16 -> [32, 16]
        return jax.lax.all_gather(x.astype(jnp.bfloat16), FSDP, tiled=True)

    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=PartitionSpec(), check_vma=False)
    x = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, spec))
    colls = hlo.collectives(_compiled_text(fn, x), 8)
    bf16_bytes = 32 * 16 * 2 * 7 // 8
    assert hlo.collective_bytes(colls)["all-gather"] == bf16_bytes
    here = hlo.collective_bytes(colls, target_forms_reduce_scatter=False)["all-gather"]
    assert here in (bf16_bytes, 2 * bf16_bytes)  # 2x where XLA:CPU widened it
    assert [c["dtype"] for c in colls] == ["bf16"]


def test_remat_lowers_the_step_memory_of_the_small_preset():
    """Per-layer remat keeps each layer's input, not its activations: the small preset's train
    step on 8 devices (micro-batch 8, seq 512) needs fewer temporaries than without."""
    temps = {}
    for remat in ("none", "layer"):
        cfg = train_plan_resolve("small", ["global_batch_tokens=4096", f"remat={remat}"])
        step = train_plan.make_plan(cfg, make_mesh(8))["programs"]["train_step"]
        temps[remat] = step["memory"]["temporaries"]
    assert temps["layer"] < 0.8 * temps["none"], temps


def test_plan_cli_with_a_context_axis(capsys):
    """`train.plan --mesh fsdp=2,context=4` with per-layer remat: each sequence in 4 slices. The
    slices' exchange is its own collective kind: the S - 1 other slices' GLA states per layer
    and sequence, forward and backward, plus each layer's conv window and the slices' decays;
    the decays are exchanged once per step, the states and windows once per layer each way (a
    remat'd layer does not exchange again); parameters are split over fsdp x context (gathers
    of 7/8); every device program is Neuron-clean."""
    status = train_plan.main(
        [
            "--config",
            "tiny",
            "global_batch_tokens=512",
            "remat=layer",
            "--mesh",
            "fsdp=2,context=4",
            "--json",
        ]
    )
    assert status == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mesh"] == {FSDP: 2, "context": 4}
    assert plan["batch"]["tokens_per_device"] == 8 * 64 // 8
    cfg, P = get_config("tiny"), plan["parameters"]
    ideal = plan["fsdp_ideal_bytes_received"]
    gla_bytes = cfg.n_layers * cfg.n_heads * cfg.d_k * cfg.d_v * 4
    local_sequences = 8 // 2  # 8 sequences over data x fsdp = 2
    assert ideal["context_exchange_per_micro_step"] == 2 * local_sequences * 3 * gla_bytes
    assert ideal["fsdp_per_micro_step"] == 12 * P * 7 // 8  # gathered over all 8 devices
    step = plan["programs"]["train_step"]
    # received per device: the states, the conv windows (W - 1 inputs of D, fp32), the decays
    conv = 2 * cfg.n_layers * local_sequences * cfg.conv_width * cfg.d_model * 4
    decay = local_sequences * 3 * cfg.n_heads * 4
    assert step["collectives"]["context-exchange"] == ideal["context_exchange_per_micro_step"] + (
        conv + decay
    )
    n = cfg.n_layers
    assert step["context_exchanges"] == {"state": 2 * n, "decay": 1, "conv": 2 * n}
    assert plan["headline"]["context_exchanges_per_step_decay"] == 1
    assert plan["programs"]["eval_step"]["context_exchanges"] == {"state": n, "decay": 1, "conv": n}
    assert plan["headline"]["neuron_census_violations"] == 0
