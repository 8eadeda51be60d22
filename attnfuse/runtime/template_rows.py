"""The Hopper dK/dV kernels' row statistics, laid out as they read them: each query row's lse in log2 units
(+inf where the row keeps no key, so its weights are 0; or, for the dK/dV template, natural as saved) and
delta = rowsum(dO ∘ O) − dlse (the softmax backward's row term), as flat float32 rows in which each (batch,
head)'s Nq values are padded with +inf (-inf when natural) and 0 to a multiple of the kernel's query block.
The kernels' steps then use them as they are, with no test of a row's place or lse a step. When the
hand-written kernel also computes dQ, the same launch computes delta (else the generated dQ kernel wrote
it) and zeroes dQ's float32 accumulator."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..launch_spec import CONSTEXPR, INT, SCALAR, TENSOR, LaunchSpec, params
from .interpreter import InterpretedKernel
from .launcher import Launcher, cdiv

ROWS = 32  # padded rows per program


def _template_rows_kernel(
    Lse,
    Delta,
    DLse,
    Out,
    DOut,
    LseRows,
    DeltaRows,
    Zeroed,
    n_rows,
    Nq,
    padded,
    H,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_gb,
    stride_gh,
    stride_gn,
    stride_gd,
    log2e,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    COMPUTE_DELTA: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    ZERO: tl.constexpr,
    NATURAL: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (b * H + h) * padded + i
    keep = row < n_rows
    bh = (row // padded).to(tl.int64)
    i = (row % padded).to(tl.int64)
    real = keep & (i < Nq)
    source = bh * Nq + i  # the row in (B, H, Nq) order
    lse = tl.load(Lse + source, mask=real, other=float("-inf"))
    if NATURAL:  # as saved: -inf where a row keeps no key and past Nq
        tl.store(LseRows + row, lse, mask=keep)
    else:
        tl.store(LseRows + row, tl.where(lse == float("-inf"), float("inf"), lse * log2e), mask=keep)
    d = tl.arange(0, HEAD_DIM)[None, :].to(tl.int64)
    if COMPUTE_DELTA:
        b = bh // H
        h = bh % H
        o = tl.load(
            Out + (b * stride_ob + h * stride_oh + i * stride_on)[:, None] + d * stride_od,
            mask=real[:, None],
            other=0.0,
        )
        g = tl.load(
            DOut + (b * stride_gb + h * stride_gh + i * stride_gn)[:, None] + d * stride_gd,
            mask=real[:, None],
            other=0.0,
        )
        delta = tl.sum(o.to(tl.float32) * g.to(tl.float32), 1)
        if HAS_DLSE:
            delta -= tl.load(DLse + source, mask=real, other=0.0)
    else:
        delta = tl.load(Delta + source, mask=real, other=0.0)
    tl.store(DeltaRows + row, delta, mask=keep)
    if ZERO:
        tl.store(Zeroed + source[:, None] * HEAD_DIM + d, tl.zeros([ROWS, HEAD_DIM], tl.float32), mask=real[:, None])


_STRIDES = tuple(f"stride_{x}{d}" for x in "og" for d in "bhnd")  # of Out and DOut, or 0s when they are unused
TEMPLATE_ROWS = LaunchSpec(
    "_template_rows_kernel",
    params(TENSOR, "Lse", "Delta", "DLse", "Out", "DOut", "LseRows", "DeltaRows", "Zeroed")
    + params(INT, "n_rows", "Nq", "padded", "H", *_STRIDES)
    + params(SCALAR, "log2e")
    + params(CONSTEXPR, "HEAD_DIM", "ROWS", "COMPUTE_DELTA", "HAS_DLSE", "ZERO", "NATURAL"),
    tiles=(),
)
_jitted = Launcher(triton.jit(_template_rows_kernel))
_interpreted = InterpretedKernel(_template_rows_kernel)


def padded_rows(n: int, block: int) -> int:
    """How many values each (batch, head) has in the template's rows: Nq rounded up to a multiple of block."""
    return cdiv(n, block) * block


def template_rows(
    lse: torch.Tensor,
    block: int,
    *,
    delta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    dout: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    zeroed: torch.Tensor | None = None,
    natural: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """lse (B, H, Nq) float32 (natural log), and either delta (B, H, Nq) float32 or out and dout (B, H, Nq,
    D), D a power of two, with dlse (B, H, Nq) float32 or None -> the template's lse rows and delta rows,
    float32 (B * H * padded_rows(Nq, block),). ``zeroed`` (B, H, Nq, D) float32, dense in any order of its
    dims with a unit last stride, if given (with out and dout), is filled with zeros (its B * H * Nq * D
    elements from its first). ``natural``: the lse rows as saved (natural log, -inf where a row keeps no key
    and past Nq), for the dK/dV template, whose normaliser's ``backward_rows`` converts them."""
    B, H, Nq = lse.shape
    padded = padded_rows(Nq, block)
    lse_rows, delta_rows = torch.empty((2, B * H * padded), dtype=torch.float32, device=lse.device)
    compute = delta is None
    if compute:
        delta = lse  # unused
        strides = (*out.stride(), *dout.stride())
    else:
        if zeroed is not None:
            raise ValueError(
                "template_rows: zeroed is filled by the launch that computes delta; pass out and dout instead of delta"
            )
        out = dout = lse  # unused
        strides = (0,) * 8
    n_rows = B * H * padded
    kernel = _jitted if lse.is_cuda else _interpreted
    kernel.launch(
        (cdiv(n_rows, ROWS),),
        TEMPLATE_ROWS.bind(
            {
                "Lse": lse.contiguous(),
                "Delta": delta.contiguous(),
                "DLse": lse if dlse is None else dlse.contiguous(),
                "Out": out,
                "DOut": dout,
                "LseRows": lse_rows,
                "DeltaRows": delta_rows,
                "Zeroed": lse if zeroed is None else zeroed,
                "n_rows": n_rows,
                "Nq": Nq,
                "padded": padded,
                "H": H,
                **dict(zip(_STRIDES, strides)),
                "log2e": math.log2(math.e),
            }
        ),
        TEMPLATE_ROWS.constexprs(
            {
                "HEAD_DIM": out.shape[3] if compute else 16,
                "ROWS": ROWS,
                "COMPUTE_DELTA": compute,
                "HAS_DLSE": dlse is not None,
                "ZERO": zeroed is not None,
                "NATURAL": natural,
            }
        ),
        device=lse.device,
    )
    return lse_rows, delta_rows
