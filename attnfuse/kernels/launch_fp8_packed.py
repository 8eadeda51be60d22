"""Launching the forward template's float8 instance of a packed call (cu_seqlens): V's transposed copy starts each
document on a column of its own (``document_values``), so that a document's key blocks meet the copy's chunks of
``fp8_pipeline.KEY_CHUNK`` keys wherever it starts in the pack; the instance finds the same column (``v_start``,
``forward_facts``) and its loader reads it there (``fp8_columns.document_loader_fp8``)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ..launch_spec import CONSTEXPR, INT, TENSOR, LaunchSpec, params
from ..runtime.interpreter import InterpretedKernel
from ..runtime.launcher import Launcher, cdiv
from .fp8_pipeline import KEY_CHUNK
from .launch import TemplateForward
from .launch_fp8 import TRANSPOSE_ROWS, Fp8TemplateForward, describe_fp8
from .launch_packed import PackedGrid
from .pipeline import ROWS


def _scatter_values(V, VT, Columns, N, svh, svn, sth, std, DV: tl.constexpr, ROWS: tl.constexpr):
    """VT[0, h, :, Columns[n]] = V[0, h, n, :] for ROWS rows n of V (a unit last stride) a program, but where
    Columns[n] is negative."""
    h = tl.program_id(1)
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, DV)
    tile = tl.load(
        V + h.to(tl.int64) * svh + n[:, None].to(tl.int64) * svn + d[None, :], mask=n[:, None] < N, other=0.0
    )
    column = tl.load(Columns + n, mask=n < N, other=-1)
    tl.store(VT + h.to(tl.int64) * sth + d[:, None].to(tl.int64) * std + column[None, :], tl.trans(tile),
             mask=column[None, :] >= 0)  # fmt: skip


SCATTER = LaunchSpec(
    "_scatter_values",
    params(TENSOR, "V", "VT", "Columns") + params(INT, "N", "svh", "svn", "sth", "std")
    + params(CONSTEXPR, "DV", "ROWS"),
    tiles=(),
)  # fmt: skip
_jitted = Launcher(triton.jit(_scatter_values))
_interpreted = InterpretedKernel(_scatter_values)


def document_columns(cu_k: torch.Tensor, docs: int, total: int) -> tuple[torch.Tensor, int]:
    """The columns of a pack's keys in V's transposed copy (``document_values``): key n of document i (keys from
    ``cu_k[i]``, offsets clamped to [0, total] as the kernels clamp them) in column v_start(i) + stored_key(n),
    v_start(i) = (cu_k[i] + KEY_CHUNK · i) rounded down to a multiple of KEY_CHUNK (the instance's ``v_start``),
    stored_key as ``fp8_pipeline.stored_key`` permutes each KEY_CHUNK keys; -1 for a row in no document. Also the
    copy's column count, which leaves a KEY_CHUNK of columns past the last document's. (total,) int32 on cu_k's
    device; torch ops, no host sync."""
    chunk = KEY_CHUNK.value
    cu = cu_k.to(torch.int64).clamp(0, total)
    row = torch.arange(total, device=cu_k.device)
    doc = (torch.searchsorted(cu, row, right=True) - 1).clamp(0, max(docs - 1, 0))
    n = row - cu[doc]
    stored = (n & ~15) | ((n & 6) << 1) | ((n & 8) >> 2) | (n & 1)
    columns = (cu[doc] + chunk * doc) // chunk * chunk + stored
    inside = (row >= cu[0]) & (row < cu[docs]) & (n < cu[doc + 1] - cu[doc])
    return torch.where(inside, columns, -1).to(torch.int32), cdiv(total + chunk * (docs + 1), chunk) * chunk


def document_values(v: torch.Tensor, cu_k: torch.Tensor, docs: int) -> torch.Tensor:
    """A packed call's v (1, Hkv, total_k, DV) float8 with a unit last stride and DV a power of two, its documents
    from the offsets ``cu_k`` -> the same values transposed, (1, Hkv, DV, columns), each document's keys from a
    column of their own (``document_columns``); the columns of no key zero. A fresh tensor."""
    _, H, N, DV = v.shape
    columns, width = document_columns(cu_k, docs, N)
    transposed = torch.zeros(1, H, DV, width, dtype=v.dtype, device=v.device)
    strides = dict(zip(("svh", "svn", "sth", "std"), (*v.stride()[1:3], *transposed.stride()[1:3])))
    (_jitted if v.is_cuda else _interpreted).launch(
        (cdiv(N, TRANSPOSE_ROWS), H),
        SCATTER.bind({"V": v, "VT": transposed, "Columns": columns, "N": N, **strides}),
        SCATTER.constexprs({"DV": DV, "ROWS": TRANSPOSE_ROWS}),
        device=v.device,
    )
    return transposed


class PackedFp8TemplateForward(PackedGrid, Fp8TemplateForward):
    """The float8 instance of a packed call: ``Fp8TemplateForward`` on a pack's grid (``PackedGrid``), reading V's
    copy by document (``plugin_args``: the pack's CuK and DOCS)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        plugin_args: dict[str, Any],
    ) -> None:
        """``TemplateForward``'s call on V's copy by document (``operands`` describes it as it is)."""
        values = document_values(v, plugin_args["CuK"], plugin_args["DOCS"])
        TemplateForward.__call__(self, q, k, values, out, lse, plugin_args)

    def operands(self, q: torch.Tensor, k: torch.Tensor, values: torch.Tensor) -> dict[str, Any]:
        """q's and k's descriptors and that of V's copy ``values`` (1, Hkv, DV, columns), and the tensors."""
        block_n = self.spec.tiles.block_n
        return {
            "q_desc": describe_fp8(q, ROWS.value, q.shape[3]),
            "k_desc": describe_fp8(k, block_n, k.shape[3]),
            "v_desc": describe_fp8(values, values.shape[2], block_n),
            "Q": q,
            "K": k,
            "V": values,
        }
