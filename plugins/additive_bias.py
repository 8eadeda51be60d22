"""additive_bias(s, bias): s + bias, bias any tensor broadcastable to (B, Hq, Nq, Nk).

The kernel reads the bias tile by tile through broadcast (stride-0) views: it is never expanded in memory.
"""

from __future__ import annotations

import torch

from attnfuse.plugin import Combinator, InputError, Param, Role, ScoreModFragment, TensorArg, hookimpl


def _broadcast(bias, B: int, Hq: int, Nq: int, Nk: int) -> torch.Tensor:
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise InputError(f"additive_bias: bias must be a float tensor, got {getattr(bias, 'dtype', type(bias))}")
    try:
        return torch.broadcast_to(bias, (B, Hq, Nq, Nk))
    except RuntimeError:
        raise InputError(
            f"additive_bias: bias of shape {tuple(bias.shape)} does not broadcast to "
            f"(B, Hq, Nq, Nk) = {(B, Hq, Nq, Nk)}"
        ) from None


def reference(s, ctx, bias):
    return s + _broadcast(bias, ctx.B, ctx.Hq, ctx.Nq, ctx.Nk)


def prepare(ctx, bias):
    return {"bias": _broadcast(bias, ctx.B, ctx.Hq, ctx.Nq, ctx.Nk)}


def examples(draw, shape):
    from hypothesis import strategies as st

    from attnfuse.plugin import random_tensor

    full = (shape.B, shape.Hq, shape.Nq, shape.Nk)
    kept = draw(st.tuples(*(st.booleans() for _ in full)))  # broadcast along the dims not kept
    return {"bias": random_tensor(draw, *(n if keep else 1 for n, keep in zip(full, kept)))}


COMBINATOR = Combinator(
    name="additive_bias",
    role=Role.SCORE_MOD,
    doc="s + bias, bias broadcastable to (B, Hq, Nq, Nk), read tile by tile.",
    params=[Param(name="bias", runtime=True, doc="float tensor broadcastable to (B, Hq, Nq, Nk)")],
    reference=reference,
    tensors=[TensorArg(name="bias", rank=4)],
    prepare=prepare,
    fragment=ScoreModFragment(
        body="""
            s = s + tl.load($bias + b.to(tl.int64) * $bias_s0 + h.to(tl.int64) * $bias_s1
                            + q_idx[:, None].to(tl.int64) * $bias_s2 + k_idx[None, :] * $bias_s3,
                            mask=in_bounds, other=0.0).to($acc_dtype)
        """,
        grad="",
        tensor_grads=[("bias", "ds")],
    ),
    examples=examples,
    takes_offsets=True,
    packed_rows=True,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
