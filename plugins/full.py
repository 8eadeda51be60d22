"""full(s): no mask; every key is kept."""

from __future__ import annotations

from attnfuse.plugin import Combinator, MaskFragment, Role, hookimpl


def reference(ctx):
    return None


COMBINATOR = Combinator(
    name="full",
    role=Role.MASK,
    doc="Keep every key (an explicit no-op mask).",
    reference=reference,
    fragment=MaskFragment(keep=None),
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
