"""sliding_window(s, left, right=0): keep q' - left <= j <= q' + right (FlashAttention's window_size)."""
from __future__ import annotations

import attnfuse
from attnfuse.checks import non_negative_int
from attnfuse.combinator import Combinator, MaskFragment, Param, Role


def reference(ctx, left, right):
    """keep (1, 1, Nq, Nk)."""
    return (ctx.k_pos >= ctx.q_pos - left) & (ctx.k_pos <= ctx.q_pos + right)


def examples(draw, shape):
    from hypothesis import strategies as st

    return {"left": draw(st.integers(0, shape.Nk + 2)), "right": draw(st.integers(0, 40))}


COMBINATOR = Combinator(
    name="sliding_window",
    role=Role.MASK,
    doc="Keep keys within `left` positions before and `right` after the query's position.",
    params=[
        Param(name="left", check=non_negative_int, doc="keys kept before the query's position"),
        Param(name="right", default=0, check=non_negative_int, doc="keys kept after it (0: causal window)"),
    ],
    reference=reference,
    fragment=MaskFragment(
        keep="(k_pos[None, :] >= q_pos[:, None] - $left) & (k_pos[None, :] <= q_pos[:, None] + $right)",
        kv_range=("$q_lo - $left", "$q_hi + $right + 1"),
        full_range=("$q_hi - $left", "$q_lo + $right + 1"),
        q_range=("$k_lo - $right", "$k_hi + $left + 1"),
        q_full_range=("$k_hi - $right", "$k_lo + $left + 1"),
    ),
    examples=examples,
)


@attnfuse.hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
