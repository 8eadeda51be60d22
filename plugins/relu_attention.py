"""relu_attention(s): weights relu(s) / Nk with no normalisation (Wortsman et al., 2023)."""
from __future__ import annotations

import torch

import attnfuse
from attnfuse.combinator import Combinator, NormaliserFragment, Role


def reference(s, keep, ctx):
    """s (B, Hq, Nq, Nk) -> weights (B, Hq, Nq, Nk); masked entries weigh 0."""
    weights = torch.relu(s) / ctx.n_keys
    if keep is not None:
        weights = weights.masked_fill(~keep, 0.0)
    return weights, None


COMBINATOR = Combinator(
    name="relu_attention",
    role=Role.NORMALISER,
    doc="Weights relu(s)/Nk, unnormalised; masked keys weigh 0.",
    reference=reference,
    fragment=NormaliserFragment(
        masked_score="0.0",
        init="",
        update="p = tl.maximum(s, 0.0) * (1.0 / Nk)",
        finalize="out = acc",
        recompute="p = tl.maximum(s, 0.0) * (1.0 / Nk)",
        grad="ds = tl.where(s > 0.0, dp * (1.0 / Nk), 0.0)",
        combine="sum",
        smooth=False,
    ),
)


@attnfuse.hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
