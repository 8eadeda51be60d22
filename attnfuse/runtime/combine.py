"""Phase two of split-KV decoding: merge each row's partial results over the key splits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_spec import CONSTEXPR, INT, TENSOR, LaunchSpec, params, strides
from .interpreter import InterpretedKernel
from .launcher import Launcher, next_power_of_2


def _combine_kernel(
    PartOut,
    PartLse,
    Out,
    Lse,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    HQ,
    Nq,
    DV,
    NUM_SPLITS,
    LOGSUMEXP: tl.constexpr,
    SAVE_LSE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0)  # (b * HQ + h) * Nq + i
    i = row % Nq
    b = row // Nq // HQ
    h = row // Nq % HQ
    s = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_DV)
    s_ok = s < NUM_SPLITS
    part = tl.load(
        PartOut + (row.to(tl.int64) * NUM_SPLITS + s[:, None]) * DV + cols[None, :],
        mask=s_ok[:, None] & (cols[None, :] < DV),
        other=0.0,
    )
    if LOGSUMEXP:  # out = Σ_s exp(lse_s - lse) out_s, lse = log Σ_s exp(lse_s)
        lse_s = tl.load(PartLse + row.to(tl.int64) * NUM_SPLITS + s, mask=s_ok, other=float("-inf"))
        m = tl.max(lse_s, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse_s - m_use)
        total = tl.sum(w, 0)
        out = tl.sum(w[:, None] * part, 0) / tl.where(total == 0.0, 1.0, total)
        if SAVE_LSE:
            tl.store(Lse + row.to(tl.int64), tl.where(total == 0.0, float("-inf"), m_use + tl.log(total)))
    else:  # an unnormalised normaliser: the splits' outputs add up
        out = tl.sum(part, 0)
    tl.store(
        Out
        + b.to(tl.int64) * stride_ob
        + h.to(tl.int64) * stride_oh
        + i.to(tl.int64) * stride_om
        + cols.to(tl.int64) * stride_od,
        out.to(Out.dtype.element_ty),
        mask=cols < DV,
    )


COMBINE = LaunchSpec(
    "_combine_kernel",
    params(TENSOR, "PartOut", "PartLse", "Out", "Lse")
    + strides("o", "bhmd", "Out")
    + params(INT, "HQ", "Nq", "DV", "NUM_SPLITS")
    + params(CONSTEXPR, "LOGSUMEXP", "SAVE_LSE", "BLOCK_S", "BLOCK_DV"),
    tiles=(),
)
_jitted = Launcher(triton.jit(_combine_kernel))
_interpreted = InterpretedKernel(_combine_kernel)


def combine(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, logsumexp: bool
) -> None:
    """part_out (B·Hq·Nq, splits, DV), part_lse (B·Hq·Nq, splits) -> out (B, Hq, Nq, DV), lse (B, Hq, Nq)."""
    B, Hq, Nq, DV = out.shape
    splits = part_out.shape[1]
    kernel = _jitted if out.is_cuda else _interpreted
    kernel.launch(
        (B * Hq * Nq,),
        COMBINE.bind(
            {
                "PartOut": part_out,
                "PartLse": part_lse,
                "Out": out,
                "Lse": out if lse is None else lse,
                "HQ": Hq,
                "Nq": Nq,
                "DV": DV,
                "NUM_SPLITS": splits,
            }
        ),
        COMBINE.constexprs(
            {
                "LOGSUMEXP": logsumexp,
                "SAVE_LSE": lse is not None,
                "BLOCK_S": max(2, next_power_of_2(splits)),
                "BLOCK_DV": max(16, next_power_of_2(DV)),
            }
        ),
        device=out.device,
    )
