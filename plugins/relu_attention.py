"""relu_attention(s): weights relu(s) / Nk with no normalisation (Wortsman et al., 2023).

A sequence with no keys (``kv_lens`` 0) gets 0, and its gradients are 0. The kernel keeps each row's weights
divided by their running maximum (when above 1) and multiplies it back at the end, so weights cast to
float16 or bfloat16 for P·V cannot overflow where the result itself fits.
"""

from __future__ import annotations

import torch

from attnfuse.plugin import Combinator, NormaliserFragment, Role, hookimpl


def reference(s, keep, ctx):
    """s (B, Hq, Nq, Nk) -> weights (B, Hq, Nq, Nk); masked entries weigh 0."""
    weights = torch.relu(s) / ctx.n_keys.clamp(min=1)
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
        init="r_i = tl.full([BLOCK_M], 1.0, dtype=$acc_dtype)",
        update="""
            p = tl.maximum(s, 0.0) * (1.0 / tl.maximum(Nk, 1))
            r_new = tl.maximum(r_i, tl.max(p, 1))
            acc = acc * (r_i / r_new)[:, None]
            p = p / r_new[:, None]
            r_i = r_new
        """,
        finalize="out = acc * r_i[:, None]",
        recompute="p = tl.maximum(s, 0.0) * (1.0 / tl.maximum(Nk, 1))",
        grad="ds = tl.where(s > 0.0, dp * (1.0 / tl.maximum(Nk, 1)), 0.0)",
        combine="sum",
        smooth=False,
        unit_weights=True,  # divided by their running maximum, which starts at 1
    ),
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
