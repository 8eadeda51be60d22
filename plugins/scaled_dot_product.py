"""scaled_dot_product(q, k, scale=None): s = q·kᵀ·scale, with scale defaulting to 1/√D."""

from __future__ import annotations

from attnfuse.plugin import Combinator, Param, Role, ScoreSourceFragment, finite_number_or_none, hookimpl


def reference(q, k, ctx, scale):
    """q (B, Hq, Nq, D), k (B, Hq, Nk, D) -> s (B, Hq, Nq, Nk)."""
    scale = ctx.D**-0.5 if scale is None else scale
    return q @ k.transpose(-1, -2) * scale


def examples(draw, shape):
    from hypothesis import strategies as st

    return {"scale": draw(st.sampled_from([None, 0.05, 0.3]))}


COMBINATOR = Combinator(
    name="scaled_dot_product",
    role=Role.SCORE_SOURCE,
    doc="Scores s = q·kᵀ·scale; scale defaults to 1/√D.",
    params=[Param(name="scale", default=None, check=finite_number_or_none, doc="multiplier of q·kᵀ; None means 1/√D")],
    reference=reference,
    fragment=ScoreSourceFragment(),
    examples=examples,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
