"""The Hopper dK/dV template's row statistics, laid out as it reads them: each query row's lse (natural, as saved,
-inf where the row keeps no key; or in log2 units, +inf there) and delta = rowsum(dO ∘ O) − dlse (the softmax
backward's row term, which the generated dQ kernel wrote), as flat float32 rows in which each (batch, head)'s Nq
values are padded with -inf (+inf in log2 units) and 0 to a multiple of the template's query block. The template's
steps then use them as they are, with no test of a row's place or lse a step."""

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
    LseRows,
    DeltaRows,
    n_rows,
    Nq,
    padded,
    log2e,
    ROWS: tl.constexpr,
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
    tl.store(DeltaRows + row, tl.load(Delta + source, mask=real, other=0.0), mask=keep)


TEMPLATE_ROWS = LaunchSpec(
    "_template_rows_kernel",
    params(TENSOR, "Lse", "Delta", "LseRows", "DeltaRows")
    + params(INT, "n_rows", "Nq", "padded")
    + params(SCALAR, "log2e")
    + params(CONSTEXPR, "ROWS", "NATURAL"),
    tiles=(),
)
_jitted = Launcher(triton.jit(_template_rows_kernel))
_interpreted = InterpretedKernel(_template_rows_kernel)


def padded_rows(n: int, block: int) -> int:
    """How many values each (batch, head) has in the template's rows: Nq rounded up to a multiple of block."""
    return cdiv(n, block) * block


def template_rows(
    lse: torch.Tensor, block: int, *, delta: torch.Tensor, natural: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """lse and delta (B, H, Nq) float32 (lse in natural log) -> the template's lse rows and delta rows, float32
    (B * H * padded_rows(Nq, block),). ``natural``: the lse rows as saved (natural log, -inf where a row keeps
    no key and past Nq), which the normaliser's ``backward_rows`` converts; else in log2 units."""
    B, H, Nq = lse.shape
    padded = padded_rows(Nq, block)
    lse_rows, delta_rows = torch.empty((2, B * H * padded), dtype=torch.float32, device=lse.device)
    n_rows = B * H * padded
    kernel = _jitted if lse.is_cuda else _interpreted
    kernel.launch(
        (cdiv(n_rows, ROWS),),
        TEMPLATE_ROWS.bind(
            {
                "Lse": lse.contiguous(),
                "Delta": delta.contiguous(),
                "LseRows": lse_rows,
                "DeltaRows": delta_rows,
                "n_rows": n_rows,
                "Nq": Nq,
                "padded": padded,
                "log2e": math.log2(math.e),
            }
        ),
        TEMPLATE_ROWS.constexprs({"ROWS": ROWS, "NATURAL": natural}),
        device=lse.device,
    )
    return lse_rows, delta_rows
