"""Greedy generation with the PyTorch Laplace: prefill, batched O(1) decode, the decode runner.

    from serve.generation import greedy_generate
    tokens = greedy_generate(model, [[1, 2, 3], [4]], max_new_tokens=16)

Prompts of any lengths are prefilled one by one (chunked GLA), then decoded together as one
batch, one token per step from the explicit `LaplaceState`. `DecodeRunner` runs the step, eager
or compiled, optionally padding each batch to one of a few fixed widths.
"""

from __future__ import annotations

import torch

from serve.modeling_laplace import LaplaceForCausalLM, LaplaceLinear, LaplaceState


@torch.no_grad()
def prefill(
    model: LaplaceForCausalLM, prompts: list[list[int]]
) -> tuple[torch.Tensor, LaplaceState]:
    """Each prompt on its own (any lengths); returns (last logits [B, V], stacked state)."""
    logits, states = [], []
    for p in prompts:
        out = model(torch.tensor([p], dtype=torch.long))
        logits.append(out.logits[:, -1])
        states.append(out.state)
    return torch.cat(logits), LaplaceState.cat(states)


@torch.no_grad()
def greedy_generate(
    model: LaplaceForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    decoder: DecodeRunner | None = None,
) -> list[list[int]]:
    """Greedy tokens for prompts of any lengths, decoded together as one batch."""
    decoder = decoder or DecodeRunner(model)
    logits, state = prefill(model, prompts)
    tokens = logits.argmax(-1)
    out = [tokens]
    for _ in range(max_new_tokens - 1):
        logits, state = decoder.step(tokens, state)
        tokens = logits.argmax(-1)
        out.append(tokens)
    return torch.stack(out, 1).tolist()


class DecodeRunner:
    """One decode step for a batch, optionally compiled, with batch-width padding.

    Compiled code specialises on the batch width; padding each batch up to the next of a few
    fixed widths (zero state rows, token 0) bounds the number of compiled shapes. Padding turns
    on the row-exact matmuls (`LaplaceLinear`), so rows never interact, not even through BLAS
    blocking: the real rows of a padded batch are bit-identical to the unpadded batch's.
    `compile=False, widths=None` is plain eager decoding, the only form for a hybrid, whose
    attention layers' keys and values grow every step (no fixed shapes to compile).
    """

    def __init__(
        self,
        model: LaplaceForCausalLM,
        *,
        compile: bool = False,
        widths: tuple[int, ...] | None = None,
        row_exact: bool | None = None,
        backend: str = "inductor",
    ):
        self.model = model
        self.hybrid = bool(model.config.laplace_config.attention_every)
        if self.hybrid and (compile or widths):
            raise ValueError(
                "a hybrid's decode step is eager and unpadded: its attention layers' keys and "
                "values grow every step (DecodeRunner(model) without compile or widths)"
            )
        self.widths = tuple(sorted(widths)) if widths else None
        self.row_exact = bool(widths) if row_exact is None else row_exact
        self.shapes_seen: set[int] = set()
        fn = self._step
        self.fn = torch.compile(fn, dynamic=False, backend=backend) if compile else fn

    def _step(self, tokens, gla, conv):
        out = self.model(tokens[:, None], LaplaceState(list(gla), list(conv)))
        return out.logits[:, 0], out.state.gla, out.state.conv

    def width_for(self, n: int) -> int:
        if not self.widths:
            return n
        for w in self.widths:
            if w >= n:
                return w
        return n  # wider than the largest bucket: run as is

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: LaplaceState):
        """tokens [B] -> (logits [B, V], new state of B rows)."""
        if self.hybrid:
            out = self.model(tokens[:, None], state)
            return out.logits[:, 0], out.state
        n = tokens.shape[0]
        w = self.width_for(n)
        self.shapes_seen.add(w)
        if w > n:
            tokens = torch.cat([tokens, tokens.new_zeros(w - n)])
            state = state.padded(w)
        for m in self.model.modules():
            if isinstance(m, LaplaceLinear):
                m.row_exact = self.row_exact
        logits, gla, conv = self.fn(tokens, tuple(state.gla), tuple(state.conv))
        state = LaplaceState(list(gla), list(conv))
        return logits[:n], (state.select(slice(0, n)) if w > n else state)


@torch.no_grad()
def stepwise_logprobs(model: LaplaceForCausalLM, prompt: list[int], tokens: list[int]):
    """Log-probabilities [len(tokens), vocab] (fp32) of each next token after `prompt` and the
    tokens before it, computed as a server computes them: the prompt prefilled, then `tokens`
    fed one at a time from the state (teacher-forced decoding)."""
    out = model(torch.tensor([prompt], dtype=torch.long))
    rows = [out.logits[0, -1]]
    for t in tokens[:-1]:
        out = model(torch.tensor([[t]], dtype=torch.long), out.state)
        rows.append(out.logits[0, -1])
    return torch.log_softmax(torch.stack(rows).float(), -1)
