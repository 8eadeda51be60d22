"""softmax_with_sinks(s, sinks): softmax whose denominator also holds a learned per-head sink logit.

Attention sinks (Xiao et al., 2023, StreamingLLM; gpt-oss, 2025): head h has a logit ``sinks[h]`` that
competes with the keys for weight but carries no value, so a head may attend to "nothing"::

    weights[j] = exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k))

``sinks`` is a float tensor (Hq,), passed at every call. The log-sum-exp includes the sink, and a row that
keeps no key gives output 0 and lse ``sinks[h]``. A sink of -inf takes no weight (plain softmax; a row
with no key: output 0, lse -inf), +inf all of it (output 0, lse +inf), and NaN gives NaN in its head's
rows. Gradients flow to q, k and v; the kernels give the sinks none, so pass them detached
(``attnfuse.hf`` adds their gradient from the lse for GPT-OSS). Partial results over disjoint keys merge
by log-sum-exp when only one of them counts the sink: the others run ``partial``, softmax's fragment,
which leaves it out. Context parallelism (``attnfuse.distributed``) does that; split-KV
decoding, whose splits are alike, is not offered.
"""

from __future__ import annotations

import math

import torch

from attnfuse.plugin import Combinator, InputError, NormaliserFragment, Param, Role, TensorArg, hookimpl
from attnfuse_plugins.softmax import COMBINATOR as SOFTMAX

LOG2E = 1.4426950408889634


def _sinks(sinks, Hq: int) -> torch.Tensor:
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (Hq,) or not sinks.is_floating_point():
        raise InputError(
            f"softmax_with_sinks: sinks must be a float tensor of shape (Hq,) = ({Hq},), got "
            f"{getattr(sinks, 'dtype', type(sinks).__name__)} {tuple(getattr(sinks, 'shape', ()))}"
        )
    return sinks


def reference(s: torch.Tensor, keep, ctx, sinks):
    """s (B, Hq, Nq, Nk) -> weights (B, Hq, Nq, Nk), lse (B, Hq, Nq), in s's dtype.

    With m = max(sink_h, max_j s_j): weights_j = exp(s_j - m) / (exp(sink_h - m) + sum_k exp(s_k - m)),
    lse = m + log(that denominator). Excluded keys score -inf and weigh 0. A -inf sink weighs 0 (a row with
    no key: weights 0, lse -inf); a +inf sink takes all the weight (weights 0, lse +inf); NaN gives NaN."""
    if keep is not None:
        s = torch.where(keep, s, torch.full_like(s, -math.inf))
    sink = _sinks(sinks, ctx.Hq).to(device=s.device, dtype=s.dtype).view(1, ctx.Hq, 1, 1)
    top = s.amax(dim=-1, keepdim=True)
    m = torch.maximum(top, sink)
    # an infinite m (no key and a -inf sink, or a +inf sink) shifts by the top score, or 0 with no key
    m = torch.where(torch.isfinite(m), m, torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    e = torch.exp(s - m)
    total = torch.exp(sink - m) + e.sum(dim=-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total), (m + torch.log(total)).squeeze(-1)


def prepare(ctx, sinks):
    return {"sinks": _sinks(sinks, ctx.Hq).to(ctx.device)}


def examples(draw, shape):
    """Sinks from far below the scores (no effect) to far above (most weight on the sink)."""
    from hypothesis import strategies as st

    noise = torch.randn(shape.Hq, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))))
    return {"sinks": noise * draw(st.sampled_from([0.5, 3.0])) + draw(st.sampled_from([-8.0, 0.0, 4.0]))}


def _update(factor: str) -> str:
    """FlashAttention's online softmax in exp2, on scores ``s * <factor>``; the state starts at the sink.
    An unchanged maximum keeps the sum as it is (alpha 1, also when it is infinite: a -inf sink and no key
    yet, or a +inf sink), and a -inf one weighs every score 0, so no inf - inf makes a NaN."""
    return f"""
        m_new = tl.maximum(m_i, tl.max(s, 1){factor})
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new == m_i, 1.0, tl.math.exp2(m_i - m_use))
        p = tl.math.exp2(s{factor} - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    """


COMBINATOR = Combinator(
    name="softmax_with_sinks",
    role=Role.NORMALISER,
    doc="Softmax with a per-head sink logit in the denominator (attention sinks, gpt-oss).",
    params=[Param(name="sinks", runtime=True, doc="(Hq,) float tensor: each head's sink logit")],
    reference=reference,
    tensors=[TensorArg(name="sinks", rank=1)],
    prepare=prepare,
    fragment=NormaliserFragment(
        score_factor=LOG2E,  # scores arrive in log2 units
        masked_score='float("-inf")',
        # The running max and sum start at the sink's term: max sink2, sum exp2(0) = 1. (h is this
        # program's head; the sum over a (BLOCK_M, 1) tile makes the shape (BLOCK_M,) either way.)
        init=f"""
            m_i = tl.sum(tl.zeros([BLOCK_M, 1], dtype=$acc_dtype)
                         + tl.load($sinks + h * $sinks_s0).to($acc_dtype) * {LOG2E}, 1)
            l_i = tl.full([BLOCK_M], 1.0, dtype=$acc_dtype)
        """,
        update=_update(""),
        scaled_update=_update(" * $factor"),
        finalize="""
            out = acc / l_i[:, None]
            lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        """,
        has_lse=True,
        # Padding rows (past Nq) arrive with lse -inf: +inf gives them p = 0 rather than NaN.
        backward_rows=f'lse2 = tl.where(lse == float("-inf"), float("inf"), lse * {LOG2E})',
        recompute="p = tl.math.exp2(s - lse2[:, None])",
        grad="ds = p * (dp - delta[:, None])",  # d lse / d s_j = p_j: the sink only changes lse
        needs_delta=True,
        combine="logsumexp",
        partial=SOFTMAX.fragment,  # a partial result over keys alone: the sink left out
        unit_weights=True,  # exp2(s - running max), the max starting at the sink
    ),
    examples=examples,
    takes_offsets=True,  # its one tensor is read by head, never by position
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
