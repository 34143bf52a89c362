"""`python -m bench.ring_soak`: the hybrid's sharded step run many times on simulated CPU devices,
to show its collectives never stall (docs/design.md s13.3: XLA:CPU starts every device's
collectives in the compiled order).

    python -m bench.ring_soak --mesh fsdp=2,context=4 --runs 1000
    python -m bench.ring_soak --mesh data=2,fsdp=2,context=2 --runs 1000 attention_context=gather

The tiny hybrid (4 layers, `attention_every=2`), its loss and gradients as the trainer takes them
(laplace_jax/fsdp.py: the FSDP block scan, `remat=layer`, the attention layers' ring or gather
form with its custom VJP, the GLA's exchange), jitted once and run `--runs` times on the same
batch; each run's loss must equal the first's. Prints the runs, the loss and the time per run.
"""

from __future__ import annotations

import argparse
import time

from train.plan import simulate_devices


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.ring_soak", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--mesh", default="fsdp=2,context=4", help="data, fsdp and context sizes")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument(
        "form", nargs="?", default="attention_context=ring", help="attention_context=ring|gather"
    )
    args = ap.parse_args(argv)
    sizes = {k: int(v) for k, v in (part.split("=") for part in args.mesh.split(","))}
    n = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("context", 1)
    simulate_devices(n)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from laplace_jax.fsdp import make_loss_and_grad
    from laplace_jax.model import ATTENTION_CONTEXT_FORMS, LaplaceLM, init_params
    from laplace_jax.sharding import make_mesh, param_shardings, param_specs
    from laplace_spec.config import get_config

    form = args.form.split("=", 1)[-1]
    if form not in ATTENTION_CONTEXT_FORMS:
        ap.error(
            f"the form is attention_context=ring or attention_context=gather, not {args.form!r}"
        )
    cfg = get_config("tiny", ["n_layers=4", "attention_every=2"])
    mesh = make_mesh(n, data=sizes.get("data", 1), context=sizes.get("context", 1))
    model = LaplaceLM(cfg, attention_context=form)
    step = jax.jit(make_loss_and_grad(model, mesh, param_specs(cfg, mesh), "layer", eot_id=3))
    params = jax.device_put(init_params(cfg, jax.random.key(0)), param_shardings(cfg, mesh))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (8, cfg.seq_len + 1)), jnp.int32)
    first, _ = jax.block_until_ready(step(params, tokens, None))
    start = time.perf_counter()
    for run in range(args.runs):
        loss, _ = jax.block_until_ready(step(params, tokens, None))
        if float(loss) != float(first):
            raise SystemExit(
                f"run {run}: loss {float(loss)} differs from the first's {float(first)}"
            )
    per_run = (time.perf_counter() - start) / args.runs
    print(
        f"{form} on {dict(mesh.shape)}: {args.runs} runs, loss {float(first):.6f} each, "
        f"{per_run * 1e3:.1f} ms a run"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
