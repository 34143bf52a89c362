"""`python -m bench.plan`: Laplace 3B on 64 simulated devices at the recipe batch, compiled only.

The recipe (docs/design.md s8): `laplace-3b`, 524,288 tokens per step (256 sequences of
2,048), micro batch 64 (4 accumulation steps), FSDP over 64 devices. Every program the trainer
puts on the devices is compiled with abstract inputs (`train.plan.make_plan`); nothing of 3B size is
allocated and nothing runs on Trainium. Prints the plan's table and writes bench/results/plan.json
(headline keys of docs/design.md s7).
"""

from __future__ import annotations

import argparse

from train.plan import print_table, simulate_devices


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="on top of the recipe")
    args = ap.parse_args(argv)
    simulate_devices(args.devices)

    from bench.common import write_result
    from laplace_jax.sharding import make_mesh
    from train import config as train_config
    from train.plan import make_plan, with_launch_settings

    # micro batch 64: 4 accumulation steps; GPT-2's end-of-text id: packed documents reset;
    # the Neuron launcher's settings (the unrolled chunk scan, host init) unless overridden
    recipe = with_launch_settings(["micro_batch_size=64", "eot_id=50256", *args.overrides])
    cfg = train_config.resolve("laplace-3b", recipe, {})
    plan = make_plan(cfg, make_mesh(args.devices))
    print_table(plan)
    headline = plan.pop("headline")
    print(write_result("plan", headline, recipe_overrides=recipe, **plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
