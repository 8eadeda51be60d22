"""Merging results over disjoint keys by the normaliser's combine rule, in the accumulators' precision."""

from __future__ import annotations

import math

import torch

Partial = tuple[torch.Tensor, torch.Tensor | None]  # out (B, H, M, DV), lse (B, H, M) or None


def merge(total: Partial | None, part: Partial, combine: str, dtype: torch.dtype) -> Partial:
    """``total`` (None: nothing yet) and ``part``, results of the same rows over disjoint keys, merged in
    ``dtype`` (float32, or float64 for float64 inputs). ``"logsumexp"``: outs weighed by exp(lse - the merged
    lse); rows with no key in either keep out 0 and lse -inf. ``"sum"``: outs added (lse None)."""
    out, lse = part[0].to(dtype), None if part[1] is None else part[1].to(dtype)
    if total is None:
        return out, lse
    if combine == "sum":
        return total[0] + out, None
    merged = torch.logaddexp(total[1], lse)
    return total[0] * _weight(total[1], merged) + out * _weight(lse, merged), merged


def _weight(lse: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """exp(lse - merged), (B, H, M, 1); 0 where no key is kept at all (merged -inf)."""
    return torch.where(merged > -math.inf, torch.exp(lse - merged), 0.0)[..., None]


def nothing(rows: tuple[int, ...], dv: int, combine: str, dtype: torch.dtype, device: torch.device) -> Partial:
    """The result of rows (B, H, M) that keep no key: out 0, and lse -inf for ``"logsumexp"``."""
    out = torch.zeros((*rows, dv), dtype=dtype, device=device)
    return out, torch.full(rows, -math.inf, dtype=dtype, device=device) if combine == "logsumexp" else None
