"""legacy_causal_radius(s, radius): causal, and only keys within ``radius`` positions of the query."""

from __future__ import annotations

import attnfuse
from attnfuse.checks import positive_number
from attnfuse.combinator import Combinator, MaskFragment, Param, Role


def reference(ctx, radius):
    """keep (B or 1, 1, Nq, Nk): k <= q' and q' - k <= radius."""
    return (ctx.k_pos <= ctx.q_pos) & ((ctx.q_pos - ctx.k_pos) <= radius)


COMBINATOR = Combinator(
    name="legacy_causal_radius",
    role=Role.MASK,
    doc="Causal, and only keys at most `radius` positions before the query.",
    params=[Param(name="radius", check=positive_number, doc="how far back a query sees, a number > 0")],
    reference=reference,
    fragment=MaskFragment(
        keep="(k_pos[None, :] <= q_pos[:, None]) & ((q_pos[:, None] - k_pos[None, :]).to(tl.float32) <= $radius)",
        kv_range=("0", "$q_hi + 1"),
        q_range=("$k_lo", "Nk"),
    ),
)


@attnfuse.hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
