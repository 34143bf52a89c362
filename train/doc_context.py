"""How long the documents of token shards are, and what that leaves a long-sequence run to learn.

A window of `seq_len + 1` tokens is cut from the concatenated documents (train/data.py); with
document resets (`doc_reset`, the default when the end-of-text id is known) the state is zeroed
at the token after each end-of-text, so a target's usable context is the tokens of its own
document before it in the window, not the window. On web text (documents of about a thousand
tokens) a 1M-token window trains no dependency longer than a document: the context axis then
carries states across slices that hold almost nothing of the same document.

- `length_summary`: the distribution of document lengths (`train.prepare` writes it to
  meta.json);
- `context_shares`: the share of scored tokens whose same-document context in their window is at
  least 1k, 8k and 64k tokens, at a run's `seq_len`, from windows sampled evenly over the shards
  (the trainer prints it as a `note:` and writes it to config.json);
- `short_documents_warning`: the warning a context-parallel run gets when few of its tokens have
  a slice's length of same-document context.
"""

from __future__ import annotations

import numpy as np

THRESHOLDS = (1024, 8192, 65536)  # tokens of same-document context
SAMPLE_TOKENS = 1 << 22  # at most this many tokens are read to estimate the shares
MIN_SLICE_SHARE = 0.1  # warn when fewer tokens than this have a slice's length of context


def _label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def length_summary(lengths) -> dict:
    """Documents' token counts -> {docs, tokens, min, median, mean, p90, p99, max, and the
    share of the tokens that lie in documents of at least 1k / 8k / 64k tokens}."""
    n = np.asarray(lengths, dtype=np.int64)
    if n.size == 0:
        return {"docs": 0, "tokens": 0}
    total = int(n.sum())
    out = {
        "docs": int(n.size),
        "tokens": total,
        "min": int(n.min()),
        "median": float(np.median(n)),
        "mean": round(float(n.mean()), 1),
        "p90": float(np.percentile(n, 90)),
        "p99": float(np.percentile(n, 99)),
        "max": int(n.max()),
    }
    for t in THRESHOLDS:
        out[f"token_share_in_docs_ge_{_label(t)}"] = round(float(n[n >= t].sum()) / total, 4)
    return out


def same_document_context(window: np.ndarray, eot_id: int | None) -> np.ndarray:
    """[T] for a window [T + 1] of tokens: how many tokens of its own document the prediction at
    input position t sees (t + 1 without resets; with them, the tokens since the last reset,
    which falls on the token after each end-of-text)."""
    inputs = window[:-1]
    T = inputs.shape[0]
    position = np.arange(T)
    if eot_id is None:
        return position + 1
    reset = np.zeros(T, bool)
    reset[1:] = inputs[:-1] == eot_id
    start = np.maximum.accumulate(np.where(reset, position, 0))
    return position - start + 1


def sampled_context(source, eot_id: int | None, windows: int = 64) -> np.ndarray:
    """Same-document context of every target of up to `windows` windows of `source` (a
    train.data.TokenWindows) spread evenly over the shards; fewer for long windows, so that at
    most SAMPLE_TOKENS tokens are read."""
    n = max(1, min(windows, len(source), SAMPLE_TOKENS // source.seq_len))
    picks = np.unique(np.linspace(0, len(source) - 1, n).round().astype(np.int64))
    return np.stack([same_document_context(source[int(i)], eot_id) for i in picks])


def context_shares(source, eot_id: int | None, context: int = 1) -> dict:
    """The shares of scored tokens with at least 1k / 8k / 64k tokens of same-document context
    at `source.seq_len`, sampled (`sampled_context`); with a context axis of `context` devices,
    also the share with at least a slice's length (seq_len / context)."""
    T = source.seq_len
    ctx = sampled_context(source, eot_id)
    out = {
        "seq_len": T,
        "sampled_windows": int(ctx.shape[0]),
        "document_resets": eot_id is not None,
        "median_context": float(np.median(ctx)),
    }
    for t in THRESHOLDS:
        out[f"share_ge_{_label(t)}"] = round(float((ctx >= t).mean()), 4)
    if context > 1:
        out["slice_tokens"] = T // context
        out["share_ge_slice"] = round(float((ctx >= T // context).mean()), 4)
    return out


def context_note(shares: dict) -> str:
    """The start-up `note:` line of `context_shares`."""
    what = "same-document context" if shares["document_resets"] else "context (no resets)"
    parts = ", ".join(
        f">= {_label(t)} tokens {shares[f'share_ge_{_label(t)}']:.1%}" for t in THRESHOLDS
    )
    return (
        f"note: {what} of the scored tokens at seq_len {shares['seq_len']:,} "
        f"({shares['sampled_windows']} sampled windows): {parts}; median "
        f"{shares['median_context']:,.0f} tokens"
    )


def short_documents_warning(shares: dict) -> str | None:
    """A context-parallel run's warning when fewer than MIN_SLICE_SHARE of the scored tokens
    have a slice's length of same-document context: the documents are much shorter than the
    sequences, and what the slices exchange holds little of the same document."""
    if "share_ge_slice" not in shares or not shares["document_resets"]:
        return None
    share, L = shares["share_ge_slice"], shares["slice_tokens"]
    if share >= MIN_SLICE_SHARE:
        return None
    return (
        f"warning: only {share:.1%} of the scored tokens have a slice's length ({L:,} tokens) of "
        f"same-document context: the documents are much shorter than the "
        f"{shares['seq_len']:,}-token sequences (median context "
        f"{shares['median_context']:,.0f} tokens), so the context axis trains no dependency "
        "longer than a document; use long documents (train.prepare --min-doc-tokens N) or "
        "doc_reset=off (docs/long-context.md)"
    )
