"""softmax(s): softmax over keys, computed online in the kernel (FlashAttention's recurrence, in exp2).

A row whose every key is masked gets weights 0 (and lse -inf), never NaN.
"""

from __future__ import annotations

import math

import torch

from attnfuse.plugin import Combinator, NormaliserFragment, Role, hookimpl


def reference(s, keep, ctx):
    """s (B, Hq, Nq, Nk) -> weights (B, Hq, Nq, Nk), lse (B, Hq, Nq)."""
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    weights = e / torch.where(total == 0, torch.ones_like(total), total)
    return weights, (m + torch.log(total)).squeeze(-1)


def _update(factor: str) -> str:
    """The online update, on scores ``s * <factor>`` (``factor`` "" for scores already scaled)."""
    return f"""
        m_new = tl.maximum(m_i, tl.max(s, 1){factor})
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s{factor} - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    """


COMBINATOR = Combinator(
    name="softmax",
    role=Role.NORMALISER,
    doc="Softmax over keys; fully masked rows give 0.",
    reference=reference,
    fragment=NormaliserFragment(
        score_factor=math.log2(math.e),  # scores arrive in log2 units, so exp2 is exact exp
        masked_score='float("-inf")',
        init="""
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=$acc_dtype)
            l_i = tl.zeros([BLOCK_M], dtype=$acc_dtype)
        """,
        update=_update(""),
        scaled_update=_update(" * $factor"),
        finalize="""
            l_use = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_use[:, None]
            lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_use)) * 0.6931471805599453)
        """,
        has_lse=True,
        backward_rows="""
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        """,
        recompute="p = tl.math.exp2(s - lse2[:, None])",
        grad="ds = p * (dp - delta[:, None])",
        needs_delta=True,
        combine="logsumexp",
        unit_weights=True,  # exp2(s - running max)
    ),
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
