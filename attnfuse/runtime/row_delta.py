"""Each query row's delta = rowsum(dO ∘ O) − dlse in float32, the softmax backward's row term, for the
Hopper dK/dV template when it also computes dQ (otherwise the generated dQ kernel writes delta); the same
launch zeroes dQ's float32 accumulator."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import InterpretedKernel
from .launcher import Launcher, cdiv

ROWS = 32  # query rows per program


def _row_delta_kernel(Out, DOut, DLse, Delta, Zeroed, n_rows, Nq, H, stride_ob, stride_oh, stride_on, stride_od,
                      stride_gb, stride_gh, stride_gn, stride_gd,
                      HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, HAS_DLSE: tl.constexpr, ZERO: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (b * H + h) * Nq + i
    keep = row < n_rows
    b = (row // Nq // H).to(tl.int64)
    h = (row // Nq % H).to(tl.int64)
    i = (row % Nq).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)[None, :].to(tl.int64)
    o = tl.load(Out + (b * stride_ob + h * stride_oh + i * stride_on)[:, None] + d * stride_od,
                mask=keep[:, None], other=0.0)
    g = tl.load(DOut + (b * stride_gb + h * stride_gh + i * stride_gn)[:, None] + d * stride_gd,
                mask=keep[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * g.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLse + row, mask=keep, other=0.0)
    tl.store(Delta + row, delta, mask=keep)
    if ZERO:
        tl.store(Zeroed + row.to(tl.int64)[:, None] * HEAD_DIM + d, tl.zeros([ROWS, HEAD_DIM], tl.float32),
                 mask=keep[:, None])


_jitted = Launcher(triton.jit(_row_delta_kernel))
_interpreted = InterpretedKernel(_row_delta_kernel)


def row_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
              zeroed: torch.Tensor | None = None) -> torch.Tensor:
    """out, dout (B, H, Nq, D), D a power of two; dlse (B, H, Nq) float32 contiguous or None
    -> delta (B, H, Nq) float32; ``zeroed`` (B, H, Nq, D) float32, dense in any order of its dims with a unit
    last stride, if given, is filled with zeros (its B * H * Nq * D elements from its first)."""
    B, H, Nq, D = out.shape
    delta = torch.empty((B, H, Nq), dtype=torch.float32, device=out.device)
    rows = B * H * Nq
    kernel = _jitted if out.is_cuda else _interpreted
    kernel.launch((cdiv(rows, ROWS),), (out, dout, delta if dlse is None else dlse, delta,
                                        delta if zeroed is None else zeroed, rows, Nq, H, *out.stride(),
                                        *dout.stride()),
                  dict(HEAD_DIM=D, ROWS=ROWS, HAS_DLSE=dlse is not None, ZERO=zeroed is not None), device=out.device)
    return delta
