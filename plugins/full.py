"""full(s): no mask; every key is kept."""
from __future__ import annotations

import attnfuse
from attnfuse.combinator import Combinator, MaskFragment, Role


def reference(ctx):
    return None


COMBINATOR = Combinator(
    name="full",
    role=Role.MASK,
    doc="Keep every key (an explicit no-op mask).",
    reference=reference,
    fragment=MaskFragment(keep=None),
)


@attnfuse.hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
