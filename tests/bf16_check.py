"""The tests' check of the bf16 contract (docs/design.md s12.4): two bf16 results computed in
fp32 and rounded once are equal but where their fp32 sums round to neighbouring bf16 values."""

from __future__ import annotations

import torch


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The gap between x's bf16 values and the next ones up in magnitude (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-126))) - 7)


def assert_one_rounding_apart(got: torch.Tensor, want: torch.Tensor, what=None, rate=1e-3):
    """Every entry of `got` within one bf16 spacing of `want`'s, and at most `rate` of them apart
    at all."""
    got, want = got.float(), want.float()
    assert ((got - want).abs() <= bf16_spacing(want)).all(), what  # one rounding apart
    assert (got != want).float().mean().item() <= rate, what  # and rarely even that
