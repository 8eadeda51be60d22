"""legacy_softmax1(s): softmax with 1 added to the denominator, weights exp(s_j) / (1 + sum_k exp(s_k))."""

from __future__ import annotations

import math

import torch

import attnfuse
from attnfuse.combinator import Combinator, NormaliserFragment, Role


def reference(s, keep, ctx):
    """weights (B, Hq, Nq, Nk), lse (B, Hq, Nq) = log(1 + sum exp(s))."""
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    m = s.amax(dim=-1, keepdim=True).clamp(min=0.0)
    total = torch.exp(-m) + torch.exp(s - m).sum(dim=-1, keepdim=True)
    return torch.exp(s - m) / total, (m + torch.log(total)).squeeze(-1)


def _update(factor: str) -> str:
    return f"""
        m_new = tl.maximum(m_i, tl.max(s, 1){factor})
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s{factor} - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    """


COMBINATOR = Combinator(
    name="legacy_softmax1",
    role=Role.NORMALISER,
    doc="Softmax with 1 added to the denominator (weights may sum to less than 1).",
    reference=reference,
    fragment=NormaliserFragment(
        score_factor=math.log2(math.e),
        masked_score='float("-inf")',
        init="""
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        """,
        update=_update(""),
        scaled_update=_update(" * $factor"),
        finalize="""
            out = acc / l_i[:, None]
            lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        """,
        has_lse=True,
        backward_rows='lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)',
        recompute="p = tl.math.exp2(s - lse2[:, None])",
        grad="ds = p * (dp - delta[:, None])",
        needs_delta=True,
    ),
)


@attnfuse.hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
