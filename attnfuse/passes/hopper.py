"""Which programs the Hopper templates serve (the forward, ``runtime/hopper_kernel.py``, and the dK/dV
kernel, ``runtime/hopper_dkdv_kernel.py``), and how.

The templates are hand-written in Gluon, not spliced from fragments: they implement the built-in
``softmax`` normaliser with a ``causal`` mask or none, on scores q·kᵀ·scale that need no qk transform in
the kernel (a transform pass may have applied one), with a positive scale (the forward keeps its running
max on q·kᵀ unscaled). Every other program, every call whose tensors TMA cannot describe, and every call
that gives its positions (``KernelConfig.positions``) runs the generated Triton kernels.
"""

from __future__ import annotations

from ..plan import HopperPlan
from .codegen import split
from .lower import LoweredProgram

HEAD_DIMS = (128,)  # those benchmarked against the generated kernel (docs/architecture.md)


def hopper_plan(lowered: LoweredProgram) -> HopperPlan | None:
    """The templates' constants for ``lowered``, or None where they do not apply."""
    c = lowered.config
    if (
        c.arch != "sm90"
        or c.dtype not in ("float16", "bfloat16")
        or c.head_dim != c.head_dim_v
        or c.head_dim not in HEAD_DIMS
        or c.kv_lens
        or c.paged
        or c.positions
        or c.varlen
        or split(lowered)
        or lowered.mods
        or lowered.normaliser.apply.combinator != "softmax"
        or not lowered.scale * lowered.score_factor > 0
    ):
        return None
    masks = [m for m in lowered.masks if m.fragment.keep is not None]
    if any(m.apply.combinator != "causal" for m in masks):
        return None
    return HopperPlan(causal=bool(masks), qk_scale=lowered.scale * lowered.score_factor, scale=lowered.scale)
