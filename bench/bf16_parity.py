"""`python -m bench.bf16_parity`: the pure model in bf16, the PyTorch reference against vLLM.

Trains `small` on the default corpus for `--steps` steps with `python -m train.main` (or takes a
bf16 export given with `--export`), exports it with `--dtype bf16`, and continues three prompts
(`PROMPTS`) greedily by `--new-tokens` tokens with the PyTorch module in bf16
(`serve.generation.greedy_generate`) and vLLM's offline engine (`serve.vllm_adapter.make_llm`,
eager, bf16 weights, fp32 state pages). Then, teacher-forced on vLLM's tokens, the module's
log-probabilities of the tokens vLLM picked against vLLM's own (docs/design.md s12.4: the bf16
contract both sides follow): the module run as vLLM runs (the prompt prefilled, then one token
at a time), and, for scale, its whole-sequence form, and the gap between its two forms; and the
prefill paths alone: vLLM's log-probabilities of the same tokens given as one prompt
(`prompt_logprobs`) against the module's whole-sequence form.

Per prompt: the leading steps on which the two agree, the largest log-probability gaps, the
smallest top-two margin of the module's greedy steps (a tie closer than the gap could flip; 0 is
two equal bf16 logits, which both sides break toward the lower token id), and at a divergence
the module's top-two margin at that step.

Writes bench/results/bf16_parity.json: headline `bf16_steps_equal_min` (the fewest leading
equal steps over the prompts), `bf16_prompts_equal` (prompts whose every step agrees),
`bf16_logprob_gap_max`, `bf16_prefill_logprob_gap_max` and `bf16_top2_margin_min`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import leading_equal, run_or_exit, write_result

PROMPTS = ("def main(", "import os", "class Config:")  # the default corpus is Python source


def train_and_export(tmp: Path, steps: int) -> Path:
    """`small` trained `steps` steps on the default corpus, exported in bf16 -> the folder."""
    run_dir, py, folder = tmp / "run", sys.executable, tmp / "bf16"
    run_or_exit(
        [py, "-m", "train.main", "--steps", str(steps), "--run-dir", str(run_dir), "--no-progress"]
    )
    ckpt = run_dir / "checkpoints"
    run_or_exit(
        [py, "-m", "export.main", "--checkpoint", str(ckpt), "--dtype", "bf16", "--out", folder]
    )
    return folder


def compare(folder: Path, n_new: int) -> list[dict]:
    """Each prompt's report (see the module's docstring) for the bf16 export in `folder`."""
    import torch
    from tokenizers import Tokenizer
    from vllm import SamplingParams

    from serve.generation import greedy_generate, stepwise_logprobs
    from serve.modeling_laplace import LaplaceForCausalLM
    from serve.vllm_adapter import make_llm

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompts = [tok.encode(text).ids for text in PROMPTS]
    llm = make_llm(str(folder), max_num_seqs=4)
    sp = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    # the same tokens again as one prompt: vLLM's prefill path, its log-probabilities of them
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    sp_prompt = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    inputs = [{"prompt_token_ids": seq} for seq in sequences]
    prefilled = llm.generate(inputs, sp_prompt, use_tqdm=False)
    del llm
    module = LaplaceForCausalLM.from_exported(folder, dtype=torch.bfloat16)
    rows = torch.arange(n_new)
    reports = []
    for text, p, seq, o, pre in zip(PROMPTS, prompts, sequences, outs, prefilled, strict=True):
        served = seq[len(p) :]
        steps = zip(o.outputs[0].logprobs, served, strict=True)
        got = torch.tensor([d[t].logprob for d, t in steps])  # vLLM's, of its own tokens
        stepwise = stepwise_logprobs(module, p, served)  # [n_new, vocab], as vLLM computes
        want = stepwise[rows, served]
        with torch.no_grad():  # the module's whole-sequence form, on the same tokens
            logits = module(torch.tensor([seq])).logits[0, len(p) - 1 : -1]
        whole = torch.log_softmax(logits.float(), -1)[rows, served]
        prefill = torch.tensor(
            [pre.prompt_logprobs[i][seq[i]].logprob for i in range(len(p), len(seq))]
        )
        reference = greedy_generate(module, [p], n_new)[0]  # the module's own greedy tokens
        if reference != served:  # the margins along the module's own tokens
            stepwise = stepwise_logprobs(module, p, reference)
        top2 = stepwise.topk(2, -1).values  # [n_new, 2]
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        equal = leading_equal(served, reference)
        reports.append(
            {
                "prompt": text,
                "steps_equal": equal,
                "logprob_gap_max": (got - want).abs().max().item(),
                "logprob_gap_max_whole_sequence": (got - whole).abs().max().item(),
                "module_forms_gap_max": (want - whole).abs().max().item(),
                "prefill_gap_max": (prefill - whole).abs().max().item(),
                "top2_margin_min": min(margins),
                "margin_at_divergence": margins[equal] if equal < n_new else None,
                "vllm_tokens": served,
                "pytorch_tokens": reference,
            }
        )
    return reports


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bf16_parity", description=__doc__)
    ap.add_argument("--steps", type=int, default=60, help="training steps of `small`")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--export", type=Path, help="a bf16 export to compare (no training)")
    ap.add_argument("--no-write", action="store_true", help="print, do not write the result")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.export or train_and_export(Path(tmp), args.steps)
        reports = compare(folder, args.new_tokens)
    for r in reports:
        parted = r["margin_at_divergence"]
        print(
            f"{r['prompt']!r:18} equal {r['steps_equal']}/{args.new_tokens}"
            f"  gap {r['logprob_gap_max']:.2e} (prefill {r['prefill_gap_max']:.2e})"
            f"  smallest top-2 margin {r['top2_margin_min']:.3f}"
            + ("" if parted is None else f"  top-2 margin where they part {parted:.4f}")
        )
    headline = {
        "bf16_steps_equal_min": min(r["steps_equal"] for r in reports),
        "bf16_prompts_equal": sum(r["steps_equal"] == args.new_tokens for r in reports),
        "bf16_logprob_gap_max": max(r["logprob_gap_max"] for r in reports),
        "bf16_prefill_logprob_gap_max": max(r["prefill_gap_max"] for r in reports),
        "bf16_top2_margin_min": min(r["top2_margin_min"] for r in reports),
    }
    print(json.dumps(headline, indent=2))
    if args.no_write:
        return 0
    path = write_result(
        "bf16_parity",
        headline,
        steps=None if args.export else args.steps,
        new_tokens=args.new_tokens,
        prompts=reports,
        seconds=round(time.perf_counter() - t0, 1),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
