"""causal(s): query i at position q' = i + Nk - Nq keeps keys j <= q'."""

from __future__ import annotations

from attnfuse.plugin import Combinator, MaskFragment, Role, hookimpl


def reference(ctx):
    """keep (1, 1, Nq, Nk)."""
    return ctx.k_pos <= ctx.q_pos


COMBINATOR = Combinator(
    name="causal",
    role=Role.MASK,
    doc="Keep keys at or before the query's position (bottom-right aligned when Nq != Nk).",
    reference=reference,
    fragment=MaskFragment(
        keep="k_pos[None, :] <= q_pos[:, None]",
        kv_range=("0", "$q_hi + 1"),
        full_range=("0", "$q_lo + 1"),
        q_range=("$k_lo", "Nk"),
        q_full_range=("$k_hi", "Nk"),
    ),
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
