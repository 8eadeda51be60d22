"""Launching the forward and dK/dV templates' instances of a packed call (cu_seqlens; the dQ template's:
``dq_launch.PackedTemplateDq``): the grids of the generated packed kernels (``passes/codegen/packed.py``), known with
no host sync, whose programs each find their document (``kernels/forward_facts.py``, ``dkdv.py``): total_q // 128 +
docs query blocks for each query head (forward), total_k // 128 + docs key blocks for each kv head (dK/dV)."""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.template_rows import padded_rows
from .launch import TemplateDkdv, TemplateForward
from .pipeline import ROWS

GRID_Y_LIMIT = 65535  # the largest grid dim y of a CUDA launch


def packed_blocks(total: int, docs: int) -> int:
    """The blocks of 2 x 64 rows (queries, or keys) of the grid of a pack of ``docs`` documents in ``total`` rows."""
    return total // (2 * ROWS.value) + docs


def fits_pack(total: int, docs: int) -> bool:
    """Whether one launch's grid holds the blocks of a pack's ``total`` query rows (forward, dQ) or keys (dK/dV)
    (else that kernel is the generated one)."""
    return packed_blocks(total, docs) <= GRID_Y_LIMIT


def document_row_stride(total_q: int, docs: int) -> int:
    """Each head's row stride in the dK/dV template's rows of a pack's lse and delta (``document_rows``)."""
    return padded_rows(total_q + ROWS.value * docs, ROWS.value)


def fits_documents(heads_q: int, total_q: int, total_k: int, docs: int) -> bool:
    """Whether one dK/dV launch's grid holds a pack's key blocks and int32 TMA coordinates its rows of lse and delta
    (``document_rows``) (else the call runs the generated dK/dV kernel)."""
    return fits_pack(total_k, docs) and heads_q * document_row_stride(total_q, docs) < 2**31


def document_rows(
    lse: torch.Tensor, delta: torch.Tensor, cu_q: torch.Tensor, docs: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """lse (natural, as saved) and delta (1, H, total_q) float32 of a pack of ``docs`` documents (query offsets
    ``cu_q``) -> the dK/dV template's rows of them, float32 (H * row_stride,), and row_stride: each head's rows
    with document i's from (cu_q[i] + 64 i) rounded down to a multiple of 64 (``packed.padded_start``: TMA reads
    a query block's from an aligned start), -inf and 0 between documents. Offsets clamped to [0, total_q] as the
    kernels clamp them; torch ops on lse's device, no host sync."""
    _, heads, total = lse.shape
    block = ROWS.value
    row_stride = document_row_stride(total, docs)
    cu = cu_q.to(torch.int64).clamp(0, total)
    row = torch.arange(total, device=lse.device)
    doc = (torch.searchsorted(cu, row, right=True) - 1).clamp(0, max(docs - 1, 0))
    first = cu[doc]
    place = ((first + block * doc) // block * block + row - first).clamp(0, row_stride - 1)
    lse_rows = torch.full((heads, row_stride), float("-inf"), dtype=torch.float32, device=lse.device)
    delta_rows = torch.zeros((heads, row_stride), dtype=torch.float32, device=lse.device)
    lse_rows[:, place] = lse[0]
    delta_rows[:, place] = delta[0]
    return lse_rows.view(-1), delta_rows.view(-1), row_stride


class PackedGrid:
    """The grid of a packed call's instance (of any kind), whose programs each find their document:
    ``plugin_args`` holds the pack's (``runtime/packed.py: launch_args``: CuQ, CuK, DOCS, SEARCH_STEPS)."""

    @staticmethod
    def blocks(rows: int, plugin_args: dict[str, Any]) -> int:
        """Programs along the pack's ``rows`` queries or keys: ``packed_blocks``."""
        return packed_blocks(rows, plugin_args["DOCS"])


class PackedTemplateForward(PackedGrid, TemplateForward):
    """The forward template's instance of a packed call, q (1, Hq, total_q, D), k and v (1, Hkv, total_k, D) (its
    launches count as ``TemplateForward``'s)."""


class PackedTemplateDkdv(PackedGrid, TemplateDkdv):
    """The dK/dV template's instance of a packed call (its launches count as ``TemplateDkdv``'s), taking
    (1, H, total, D) tensors as ``TemplateDkdv`` takes (B, H, N, D) ones (``fits_documents`` besides ``fits``). A
    program has all of its GQA group's query heads (GROUP_SUM "none"): a split group's partial sums are laid out by
    key block of one sequence, not of a document."""

    @staticmethod
    def rows(
        lse: torch.Tensor, delta: torch.Tensor, plugin_args: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The pack's rows, each document's from an aligned start: ``document_rows``."""
        return document_rows(lse, delta, plugin_args["CuQ"], plugin_args["DOCS"])

    @staticmethod
    def split(
        q: torch.Tensor, k: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
    ) -> tuple[int, str, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One part, summing nothing: dk and dv stand for the buffers, unread."""
        return 1, "none", dk, dv, dk
