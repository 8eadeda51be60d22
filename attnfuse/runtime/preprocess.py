"""The backward's preprocessing kernel: delta = rowsum(dO ∘ O) - dLSE, one float32 per query row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import InterpretedKernel
from .launcher import Launcher, cdiv, next_power_of_2


def _delta_kernel(O, DO, DLse, Delta,
                  stride_ob, stride_oh, stride_om, stride_od,
                  stride_dob, stride_doh, stride_dom, stride_dod,
                  HQ, Nq, DV,
                  HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_DV)
    ok = (rows[:, None] < Nq) & (cols[None, :] < DV)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_om
                + cols[None, :] * stride_od, mask=ok, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows[:, None] * stride_dom
                 + cols[None, :] * stride_dod, mask=ok, other=0.0)
    delta = tl.sum(o.to(Delta.dtype.element_ty) * do.to(Delta.dtype.element_ty), 1)
    if HAS_DLSE:
        delta -= tl.load(DLse + pid_bh.to(tl.int64) * Nq + rows, mask=rows < Nq, other=0.0)
    tl.store(Delta + pid_bh.to(tl.int64) * Nq + rows, delta, mask=rows < Nq)


_jitted = Launcher(triton.jit(_delta_kernel))
_interpreted = InterpretedKernel(_delta_kernel)


def delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """out, dout (B, Hq, Nq, DV); dlse (B, Hq, Nq) or None -> delta (B, Hq, Nq), contiguous, float32
    (float64 for float64 inputs)."""
    B, Hq, Nq, DV = out.shape
    result = torch.empty((B, Hq, Nq), dtype=torch.float64 if out.dtype == torch.float64 else torch.float32,
                         device=out.device)
    if result.numel() == 0:
        return result
    block_m = 64 if out.is_cuda else 32
    kernel = _jitted if out.is_cuda else _interpreted
    dlse = dlse.to(result.dtype).contiguous() if dlse is not None else None
    kernel[(cdiv(Nq, block_m), B * Hq)](
        out, dout, result if dlse is None else dlse, result, *out.stride(), *dout.stride(), Hq, Nq, DV,
        HAS_DLSE=dlse is not None, BLOCK_M=block_m, BLOCK_DV=max(16, next_power_of_2(DV)))
    return result
