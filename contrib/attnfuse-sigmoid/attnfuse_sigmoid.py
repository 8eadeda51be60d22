"""sigmoid_attention(s, bias=None): weights sigmoid(s + bias), not normalised over keys.

Sigmoid attention (Ramapuram et al., 2024, "Theory, Analysis, and Best Practices for Sigmoid
Self-Attention") replaces softmax by an element-wise sigmoid; a bias b = -log(n), n the number of keys,
keeps the weights' sum near 1 at the start of training. ``bias=None`` means that default (n: the key
capacity Nk, or the sequence's length ``seq_len`` for a call on a chunk of it); a number overrides it::

    @af.attention
    def sigmoid_causal(q, k, v):
        return af.sigmoid_attention(af.causal(af.scaled_dot_product(q, k))) @ v

Each weight depends on its own score only, so results over disjoint key splits add up (``combine="sum"``)
and split-KV decoding works; there is no log-sum-exp to return.
"""

from __future__ import annotations

import math

import torch

from attnfuse.plugin import (
    Combinator,
    NormaliserFragment,
    Param,
    Role,
    ScalarArg,
    UnsupportedError,
    finite_number_or_none,
    hookimpl,
)

__all__ = ["COMBINATOR", "attnfuse_combinators", "examples", "offset", "reference"]
__version__ = "0.1.0"


def offset(bias, Nk: int) -> float:
    """The bias added to every score: ``bias``, or -log(Nk) (-log 1 = 0 for no keys) when None."""
    return -math.log(max(Nk, 1)) if bias is None else float(bias)


def reference(s: torch.Tensor, keep, ctx, bias):
    """s (B, Hq, Nq, Nk) -> weights sigmoid(s + b) (B, Hq, Nq, Nk), excluded keys 0; no lse.

    torch.sigmoid rather than 1 / (1 + exp(-x)): in float16, exp(-x) overflows for x < -11 and the
    gradient of the written-out formula becomes inf / inf = NaN (the tests check the formula in float64)."""
    weights = torch.sigmoid(s + offset(bias, ctx.seq_len))
    if keep is not None:
        weights = torch.where(keep, weights, torch.zeros_like(weights))
    return weights, None


def prepare(ctx, bias):
    """The offset is a kernel argument (not a literal): -log(Nk) changes with every key count (the sequence's
    length ``seq_len`` for a chunk of it, as in context parallelism; Nk otherwise). A packed call's documents
    each have their own key count, which the host does not know: the default bias is refused there."""
    if bias is None and ctx.cu_seqlens_k is not None:
        raise UnsupportedError(
            "sigmoid_attention: bias=None means -log(the sequence's key count), and each document of a packed call "
            "(cu_seqlens_k) has its own, which the kernel does not take yet: pass bias= explicitly (a number)"
        )
    return {"offset": offset(bias, ctx.seq_len)}


def examples(draw, shape):
    """Parameters for the conformance kit: the default, zero, and biases that shift the sigmoid."""
    from hypothesis import strategies as st

    return {"bias": draw(st.sampled_from([None, 0.0, -3.0, 2.5]))}


# sigmoid(x) from e = exp(-|x|) in (0, 1], which never overflows: 1 / (1 + e) for x >= 0, e / (1 + e)
# below. An excluded key (x = -inf) gets e = 0, so weight exactly 0.
_SIGMOID = """
    x_sig = s + $offset
    e_sig = tl.exp(-tl.abs(x_sig))
    p = tl.where(x_sig >= 0.0, 1.0 / (1.0 + e_sig), e_sig / (1.0 + e_sig))
"""


COMBINATOR = Combinator(
    name="sigmoid_attention",
    role=Role.NORMALISER,
    doc="Sigmoid attention: weights sigmoid(s + bias), bias None meaning -log(Nk); not normalised.",
    params=[Param(name="bias", default=None, check=finite_number_or_none, doc="added to the scores; None: -log(Nk)")],
    reference=reference,
    scalars=[ScalarArg(name="offset")],
    prepare=prepare,
    fragment=NormaliserFragment(
        masked_score='float("-inf")',  # 1 / (1 + exp(inf)) = 0: excluded keys weigh nothing
        init="",
        update=_SIGMOID,
        finalize="out = acc",
        recompute=_SIGMOID,
        grad="ds = dp * p * (1.0 - p)",  # sigmoid' = sigmoid (1 - sigmoid)
        combine="sum",
        unit_weights=True,  # a sigmoid
    ),
    examples=examples,
    takes_offsets=True,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
