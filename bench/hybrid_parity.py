"""`python -m bench.hybrid_parity`: greedy tokens of a trained hybrid, JAX = PyTorch = vLLM.

Trains the tiny hybrid (`--config tiny attention_every=2`: a GLA layer, then an attention layer)
on the default corpus with `python -m train.main`, exports its last checkpoint in fp32 and bf16
with `python -m export.main`, and greedily continues three prompts (`PROMPTS`) by `--new-tokens`
tokens with: JAX (`laplace_jax.generate.greedy_generate`, which recomputes the whole
sequence for each token of a model with attention layers), the PyTorch model, vLLM eager and
vLLM compiled (fp32); then the bf16 export with the PyTorch model in bf16 and vLLM eager in bf16
(the write-up's check: the steps on which the two agree before they first differ).

`--set KEY=VALUE ...` adds model settings to the training run (a branch form of docs/design.md
s13.5, e.g. `--set gla_branch=post_norm attention_input=stream_and_embedding`) and `--result
NAME` writes bench/results/NAME.json instead.

Writes bench/results/hybrid_parity.json: headline `hybrid_greedy_equal_fp32` (1 when every
prompt's tokens are equal across the four, else the share of prompts that are) and
`hybrid_bf16_steps_equal_min` (the fewest leading steps on which bf16 vLLM and bf16 PyTorch
agree, over the prompts), the tokens themselves and the training run's losses.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import leading_equal, run_or_exit, write_result

PROMPTS = (  # the default corpus is Python's standard library source
    "def read_config(path):\n    with open(path) as f:\n",
    'class Queue:\n    """A first-in, first-out queue."""\n\n    def __init__(self',
    "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = ",
)


def _prompts(folder: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [tok.encode(text).ids for text in PROMPTS]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hybrid_parity", description=__doc__)
    ap.add_argument("--steps", type=int, default=300, help="training steps of the tiny hybrid")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model settings")
    ap.add_argument("--result", default="hybrid_parity", help="bench/results/<RESULT>.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, py = Path(tmp) / "run", sys.executable
        train = [py, "-m", "train.main", "--config", "tiny", "attention_every=2", *args.set]
        run_or_exit(
            train + ["--steps", str(args.steps), "--run-dir", str(run_dir), "--no-progress"]
        )
        ckpt, folders = run_dir / "checkpoints", {}
        for dtype in ("fp32", "bf16"):
            folders[dtype] = Path(tmp) / dtype
            export = [py, "-m", "export.main", "--checkpoint", str(ckpt), "--dtype", dtype]
            run_or_exit(export + ["--out", str(folders[dtype])])
        prompts = _prompts(folders["fp32"])
        tokens = greedy_everywhere(ckpt, folders, prompts, args.new_tokens)
        losses = [
            json.loads(line)["loss"]
            for line in (run_dir / "metrics.jsonl").open()
            if '"loss"' in line
        ]
    fp32 = ["jax", "pytorch", "vllm_eager", "vllm_compiled"]
    equal = [all(tokens[k][i] == tokens["jax"][i] for k in fp32) for i in range(len(prompts))]
    pairs = zip(tokens["vllm_bf16"], tokens["pytorch_bf16"], strict=True)
    agree = [leading_equal(a, b) for a, b in pairs]
    headline = {
        "hybrid_greedy_equal_fp32": sum(equal) / len(equal),
        "hybrid_bf16_steps_equal_min": min(agree),
    }
    path = write_result(
        args.result,
        headline,
        steps=args.steps,
        settings=args.set,
        loss_first_last=[losses[0], losses[-1]],
        prompts=prompts,
        new_tokens=args.new_tokens,
        tokens=tokens,
        fp32_equal_per_prompt=equal,
        bf16_leading_steps_equal=agree,
        seconds=time.perf_counter() - t0,
    )
    print(json.dumps(headline, indent=2))
    print(f"wrote {path}")
    return 0


def greedy_everywhere(ckpt: Path, folders: dict, prompts, n: int) -> dict[str, list]:
    """{who: [tokens of each prompt]} for JAX (the checkpoint's parameters), PyTorch and vLLM
    (the fp32 export; vLLM eager and compiled), and PyTorch and vLLM on the bf16 export."""
    import numpy as np
    import torch

    from export.exporter import read_checkpoint
    from laplace_jax.generate import greedy_generate as jax_greedy
    from serve.configuration_laplace import LaplaceHFConfig
    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM
    from serve.vllm_adapter import generate, make_llm

    fp32 = folders["fp32"]
    cfg = LaplaceHFConfig.from_pretrained(fp32).laplace_config
    params, _, _ = read_checkpoint(ckpt)
    out: dict[str, list] = {
        "jax": [np.asarray(jax_greedy(params, cfg, np.array(p), n)).tolist() for p in prompts]
    }
    for dtype, key in ((torch.float32, "pytorch"), (torch.bfloat16, "pytorch_bf16")):
        folder = folders["fp32" if dtype == torch.float32 else "bf16"]
        model = LaplaceForCausalLM.from_exported(folder, dtype=dtype)
        out[key] = [greedy_generate(model, [p], n)[0] for p in prompts]
    for key, folder, compile_ in (
        ("vllm_eager", fp32, False),
        ("vllm_compiled", fp32, True),
        ("vllm_bf16", folders["bf16"], False),
    ):
        llm = make_llm(str(folder), max_num_seqs=4, compile=compile_)
        out[key] = [o["token_ids"] for o in generate(llm, prompts, n, ignore_eos=True)]
        del llm
    return out


if __name__ == "__main__":
    raise SystemExit(main())
