"""The reference evaluator: runs a program naively in PyTorch by composing the plugins' references.

It materialises the (B, Hq, Nq, Nk) score matrix, so it is for testing and small shapes: the oracle every
test compares the fused kernels against, in float64 when asked.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from attrs import frozen

from . import ir
from .errors import InputError
from .runtime.kv_layout import head_second

PRECISIONS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def check_precision(dtype: Any) -> None:
    """Refuse an evaluator ``dtype`` other than the floating dtypes it computes in (None is not "the inputs'")."""
    if dtype not in PRECISIONS:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in PRECISIONS)
        raise InputError(f"dtype={dtype!r}: the reference evaluates in one of {allowed} (float64 by default)")


@frozen(kw_only=True, eq=False)
class Context:
    """What a reference implementation may read besides its own parameters.

    Positions follow bottom-right alignment: query i of sequence b sits at position ``i + n_keys[b] - Nq``,
    key j at ``j``, where ``n_keys`` (B or 1, 1, 1, 1) counts each sequence's keys (``Nk`` unless the call
    gave kv_lens). ``q_idx`` is (1, 1, Nq, 1), ``q_pos`` (B or 1, 1, Nq, 1), ``k_pos`` (1, 1, 1, Nk); all
    int64, so that they broadcast against scores (B, Hq, Nq, Nk). ``dtype`` is the evaluator's precision.
    A call that gives its positions places query i at ``q_offset + i`` and key j at ``k_offset + j`` in a
    sequence of ``seq_len`` keys (``n_keys``); without them ``q_offset`` is None and ``seq_len`` is Nk.
    """

    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    DV: int
    q_idx: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    n_keys: torch.Tensor
    dtype: torch.dtype
    device: torch.device
    q_offset: int | None = None
    k_offset: int = 0
    seq_len: int = attrs.field(default=attrs.Factory(lambda self: self.Nk, takes_self=True))


def make_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype,
    kv_lens: torch.Tensor | None = None,
    positions: Any = None,
) -> Context:
    """The context of inputs q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV), kv_lens (B,) or None,
    and the call's ``Positions`` (``runtime.inputs``) or None."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk, DV = k.shape[1], k.shape[2], v.shape[3]
    q_idx = torch.arange(Nq, device=q.device).view(1, 1, Nq, 1)
    k_pos = torch.arange(Nk, device=q.device).view(1, 1, 1, Nk)
    sizes = dict(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, DV=DV, q_idx=q_idx, dtype=dtype, device=q.device)
    if positions is not None:
        return Context(
            **sizes,
            q_pos=q_idx + positions.q_offset,
            k_pos=k_pos + positions.k_offset,
            n_keys=torch.full((1, 1, 1, 1), positions.seq_len, device=q.device),
            **positions._asdict(),
        )
    n_keys = (
        torch.full((1, 1, 1, 1), Nk, device=q.device)
        if kv_lens is None
        else kv_lens.to(device=q.device, dtype=torch.int64).clamp(max=Nk).view(B, 1, 1, 1)
    )
    return Context(**sizes, q_pos=q_idx + n_keys - Nq, k_pos=k_pos, n_keys=n_keys)


def packed_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, cu_q: torch.Tensor, cu_k: torch.Tensor
) -> tuple[Context, torch.Tensor]:
    """The context of a packed call over its whole row (q (1, Hq, total_q, D), k and v (1, Hkv, total_k, D)
    holding documents at the offsets cu_q, cu_k (docs + 1,)), and which (query, key) pairs share a document,
    (1, 1, total_q, total_k) bool. Each document is its own sequence: positions restart in it (query i of a
    document of n_q queries and n_k keys at i + n_k - n_q, key j at j) and ``n_keys`` (1, 1, total_q, 1) is
    its query's document's key count; ``q_idx`` and the sizes are the packed row's, as a packed call's
    tensors are indexed."""
    ctx = make_context(q, k, v, dtype)
    q_doc, q_local = _documents(cu_q, ctx.Nq, q.device)
    k_doc, k_local = _documents(cu_k, ctx.Nk, q.device)
    n_q, n_k = (cu[1:] - cu[:-1] for cu in (cu_q.long(), cu_k.long()))
    rows = (q_local + (n_k - n_q).to(q.device)[q_doc]).view(1, 1, ctx.Nq, 1)
    same = (q_doc.view(-1, 1) == k_doc.view(1, -1)).view(1, 1, ctx.Nq, ctx.Nk)
    n_keys = n_k.to(q.device)[q_doc].view(1, 1, ctx.Nq, 1)
    return attrs.evolve(ctx, q_pos=rows, k_pos=k_local.view(1, 1, 1, ctx.Nk), n_keys=n_keys), same


def _documents(cu: torch.Tensor, total: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of ``total`` packed rows' document (the last one that starts at or before it) and its index in it."""
    starts = cu.long().to(device)
    row = torch.arange(total, device=device)
    doc = torch.searchsorted(starts, row, right=True) - 1
    return doc, row - starts[doc]


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor, kv_layout: str = "NHD") -> torch.Tensor:
    """A paged pool in ``kv_layout`` ("NHD": (pages, page_size, H, D); "HND": (pages, H, page_size, D)) and
    block table (B, max_pages) -> (B, H, max_pages·page_size, D). Entries outside the pool (unused ones, past
    a sequence's length, may hold anything) read the nearest page."""
    B, pages = block_table.shape
    pool = head_second(pool, kv_layout)  # (pages, H, page_size, D)
    rows = pool[block_table.long().clamp(0, max(pool.shape[0] - 1, 0))]  # (B, max_pages, H, page_size, D)
    return rows.transpose(1, 2).reshape(B, pool.shape[1], pages * pool.shape[2], pool.shape[3])


def _values(app: ir.Apply, inputs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {
        name: value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        for name, value in app.values(inputs).items()
    }


def evaluate(
    graph: ir.MatMulPV,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inputs: dict[str, Any],
    dtype: torch.dtype = torch.float64,
    kv_lens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    positions: Any = None,
    kv_layout: str = "NHD",
    dropout: tuple[torch.Tensor, float] | None = None,
    packed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``graph`` naively in ``dtype``.

    :param inputs: the runtime inputs by argument name (bias, cos/sin tables, block masks).
    :param kv_lens: (B,) keys per sequence, or None; ``block_table``: k, v are paged pools in ``kv_layout``
        (see run_attention; here "NHD" or "HND", as decided).
    :param positions: the call's ``Positions`` (q_offset, k_offset, seq_len), or None.
    :param dropout: (keep (B, Hq, Nq, Nk) bool, p): attention dropout, the normalised weights times keep / (1 - p)
        (the lse is the undropped weights'); None: no dropout.
    :param packed: (cu_seqlens_q, cu_seqlens_k), valid offsets of a packed call's documents: the whole row at
        once, each pair of rows kept only within a document (``packed_context``).
    :return: out (B, Hq, Nq, DV) and lse (B, Hq, Nq), natural log, or None if the normaliser has none.
    """
    check_precision(dtype)
    if block_table is not None:
        k, v = gather_pages(k, block_table, kv_layout), gather_pages(v, block_table, kv_layout)
    keep = None
    if packed is None:
        ctx = make_context(q, k, v, dtype, kv_lens, positions)
        if kv_lens is not None:
            keep = ctx.k_pos < ctx.n_keys  # keys past a sequence's length do not exist
    else:
        ctx, keep = packed_context(q, k, v, dtype, *packed)
    group = ctx.Hq // ctx.Hkv
    q = q.to(dtype)
    k = k.to(dtype).repeat_interleave(group, dim=1)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    nodes = ir.chain(graph)
    score: ir.ScoreOp = nodes[0]
    for t in score.transforms:
        q, k = t.declaration.reference(q, k, ctx, **_values(t, inputs, dtype))
    s = score.source.declaration.reference(q, k, ctx, **_values(score.source, inputs, dtype))
    for node in nodes[1:-2]:
        comb = node.apply.declaration
        values = _values(node.apply, inputs, dtype)
        if isinstance(node, ir.MaskOp):
            kept = comb.reference(ctx, **values)
            if kept is not None:
                keep = kept if keep is None else keep & kept
        else:
            s = comb.reference(s, ctx, **values)
    norm: ir.NormOp = nodes[-2]
    weights, lse = norm.apply.declaration.reference(s, keep, ctx, **_values(norm.apply, inputs, dtype))
    if dropout is not None:
        kept, p = dropout
        weights = torch.where(kept, weights / (1.0 - p), 0.0)
    return weighted_values(weights, v, keep), lse


def weighted_values(weights: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """weights (B, H, Nq, Nk) @ v (B, H, Nk, DV), where masked keys contribute nothing, not even a NaN or inf
    of theirs (0 · NaN would be NaN): a row's column is NaN only where a key it keeps is non-finite."""
    if keep is None or torch.isfinite(v).all():
        return weights @ v
    return _MaskedProduct.apply(weights, v, keep)


class _MaskedProduct(torch.autograd.Function):
    """weights @ v over kept keys only; its gradients are the math's: dW = dOut·vᵀ on kept pairs (NaN where
    the kept value is), 0 on masked ones; dV = Wᵀ·dOut."""

    @staticmethod
    def forward(ctx, weights, v, keep):
        finite = torch.isfinite(v)
        bad = (keep.to(v.dtype) @ (~finite).to(v.dtype)) > 0
        ctx.save_for_backward(weights, v, keep)
        return (weights @ torch.where(finite, v, 0.0)).masked_fill(bad, float("nan"))

    @staticmethod
    def backward(ctx, grad):
        weights, v, keep = ctx.saved_tensors
        grad_weights = torch.where(keep, grad @ v.transpose(-1, -2), 0.0) if ctx.needs_input_grad[0] else None
        grad_v = weights.transpose(-1, -2) @ grad if ctx.needs_input_grad[1] else None
        return grad_weights, grad_v, None
