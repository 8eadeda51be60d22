"""Which programs the Hopper forward template (``runtime/hopper_kernel.py``) serves, and how.

The template is hand-written in Gluon, not spliced from fragments: it implements the built-in ``softmax``
normaliser with a ``causal`` mask or none, on scores q·kᵀ·scale that need no qk transform in the kernel
(a transform pass may have applied one). Every other program, and every call whose tensors TMA cannot
describe, runs the generated Triton forward.
"""
from __future__ import annotations

from attrs import frozen

from .codegen import split
from .lower import LoweredProgram

HEAD_DIMS = (128,)  # those benchmarked against the generated kernel (docs/architecture.md)


@frozen
class HopperForward:
    """The template's constants for one program: ``causal`` (else no mask), the scores' factor in log2
    units, and its tiles (keys per block, shared-memory stages)."""

    causal: bool
    qk_scale: float
    block_n: int = 128
    stages: int = 3


def hopper_forward(lowered: LoweredProgram) -> HopperForward | None:
    """The template's constants for ``lowered``, or None where it does not apply."""
    c = lowered.config
    if (c.arch != "sm90" or c.dtype not in ("float16", "bfloat16") or c.head_dim != c.head_dim_v
            or c.head_dim not in HEAD_DIMS or c.kv_lens or c.paged or split(lowered) or lowered.mods
            or lowered.normaliser.apply.combinator != "softmax"):
        return None
    masks = [m for m in lowered.masks if m.fragment.keep is not None]
    if any(m.apply.combinator != "causal" for m in masks):
        return None
    return HopperForward(causal=bool(masks), qk_scale=lowered.scale * lowered.score_factor)
