"""full(s): no mask; every key is kept."""

from __future__ import annotations

from attnfuse.combinator import Combinator, MaskFragment, Role
from attnfuse.hookspecs import hookimpl


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
