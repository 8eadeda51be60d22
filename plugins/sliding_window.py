"""sliding_window(s, left, right=0): keep q' - left <= j <= q' + right (FlashAttention's window_size)."""

from __future__ import annotations

from attnfuse.plugin import Combinator, MaskFragment, Param, Role, hookimpl, non_negative_int


UNBOUNDED = 2**30
"""A side of the window at least this wide has no bound: its condition and facts are left out of the kernel.
That is exact for sequences of up to 2**30 keys (no key lies further away), and keeps the int32 position
arithmetic of the kernels from overflowing (``q_hi + right + 1`` with right = 2**31 would)."""


def reference(ctx, left, right):
    """keep (1, 1, Nq, Nk). Sides are clamped to 2**40, wider than any two positions are apart (both lie in
    (-2**31, 2**31)), so the int64 position arithmetic cannot overflow (``q_pos + (2**63 - 1)`` would)."""
    left, right = min(left, 2**40), min(right, 2**40)
    return (ctx.k_pos >= ctx.q_pos - left) & (ctx.k_pos <= ctx.q_pos + right)


def fragment(left, right):
    """The mask's fragment; a side at least ``UNBOUNDED`` wide keeps everything on that side."""
    bounded_left, bounded_right = left < UNBOUNDED, right < UNBOUNDED
    keep = [
        c
        for c, bounded in (
            ("(k_pos[None, :] >= q_pos[:, None] - $left)", bounded_left),
            ("(k_pos[None, :] <= q_pos[:, None] + $right)", bounded_right),
        )
        if bounded
    ]
    return MaskFragment(
        keep=" & ".join(keep) or None,
        kv_range=("$q_lo - $left" if bounded_left else "0", "$q_hi + $right + 1" if bounded_right else "Nk"),
        full_range=("$q_hi - $left" if bounded_left else "0", "$q_lo + $right + 1" if bounded_right else "Nk"),
        q_range=("$k_lo - $right" if bounded_right else "0", "$k_hi + $left + 1" if bounded_left else "Nk"),
        q_full_range=("$k_hi - $right" if bounded_right else "0", "$k_lo + $left + 1" if bounded_left else "Nk"),
    )


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
    fragment=fragment,
    examples=examples,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
