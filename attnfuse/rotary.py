"""The rotations of RoPE, shared by rope's reference and the baselines: NeoX/Llama's half split (HF
``rotate_half``) and GPT-J's interleaved pairs (HF ``rotate_every_two``)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): the halves (x1, x2) of the last dim become (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): each pair (x[2i], x[2i+1]) of the last dim becomes (-x[2i+1], x[2i]) (GPT-J's
    interleaved rotation, HF ``rotate_every_two``)."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
