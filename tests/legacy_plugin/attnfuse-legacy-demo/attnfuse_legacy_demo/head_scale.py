"""legacy_head_scale(s, weights): s * w_h, a per-head weight tensor (Hq,)."""

from __future__ import annotations

import torch

import attnfuse
from attnfuse.combinator import Combinator, Param, Role, ScoreModFragment, TensorArg


def _weights(weights, Hq: int) -> torch.Tensor:
    if not isinstance(weights, torch.Tensor) or weights.shape != (Hq,) or not weights.is_floating_point():
        raise attnfuse.InputError(
            f"legacy_head_scale: weights must be a float tensor of shape (Hq,) = ({Hq},), "
            f"got {getattr(weights, 'shape', type(weights).__name__)}"
        )
    return weights


def reference(s, ctx, weights):
    """s (B, Hq, Nq, Nk) -> s * w_h."""
    return s * _weights(weights, ctx.Hq).to(s.device, s.dtype).view(1, ctx.Hq, 1, 1)


def prepare(ctx, weights):
    return {"weights": _weights(weights, ctx.Hq).to(ctx.device)}


def examples(draw, shape):
    from attnfuse.testing import random_tensor

    return {"weights": random_tensor(draw, shape.Hq)}


COMBINATOR = Combinator(
    name="legacy_head_scale",
    role=Role.SCORE_MOD,
    doc="s * w_h: the scores of head h times a per-head weight.",
    params=[Param(name="weights", runtime=True, doc="(Hq,) float tensor: one weight per query head")],
    reference=reference,
    tensors=[TensorArg(name="weights", rank=1)],
    prepare=prepare,
    fragment=ScoreModFragment(
        prologue="${self}_w = tl.load($weights + h * $weights_s0).to(tl.float32)",
        body="s = s * ${self}_w",
        grad="ds = ds * ${self}_w",
    ),
    examples=examples,
)


@attnfuse.hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
