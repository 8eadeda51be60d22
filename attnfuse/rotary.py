"""The NeoX/Llama half-split rotation (HF ``rotate_half``), shared by rope's reference and the baselines."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): the halves (x1, x2) of the last dim become (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
