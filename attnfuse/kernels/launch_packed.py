"""Launching the forward and dK/dV templates' instances of a packed call (cu_seqlens; the dQ template's:
``dq_launch.PackedTemplateDq``): the grids of the generated packed kernels (``passes/codegen/packed.py``), known with
no host sync, whose programs each find their document (``kernels/forward_facts.py``, ``dkdv.py``): total_q // 128 +
docs query blocks for each query head (forward), total_k // 128 + docs key blocks for each kv head (dK/dV)."""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.hopper import HopperLauncher
from ..runtime.template_rows import padded_rows
from .descriptors import describe
from .launch import TemplateDkdv, TemplateForward
from .pipeline import LAUNCH_REGISTERS, ROWS

GRID_Y_LIMIT = 65535  # the largest grid dim y of a CUDA launch


class PackedTemplateForward(TemplateForward):
    """The forward template's instance of a packed call (its launches count as ``TemplateForward``'s)."""

    @staticmethod
    def blocks(total: int, docs: int) -> int:
        """The blocks of 2 x 64 rows (queries, or keys) of the grid of a pack of ``docs`` documents in ``total``
        rows."""
        return total // (2 * ROWS.value) + docs

    @classmethod
    def fits_pack(cls, total: int, docs: int) -> bool:
        """Whether one launch's grid holds the blocks of a pack's ``total`` query rows (forward, dQ) or keys
        (dK/dV) (else that kernel is the generated one)."""
        return cls.blocks(total, docs) <= GRID_Y_LIMIT

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        plugin_args: dict[str, Any],
    ) -> None:
        """q (1, Hq, total_q, D), k and v (1, Hkv, total_k, D) with total_q, total_k >= 1 -> out (1, Hq, total_q, D)
        and, if given, lse (1, Hq, total_q) float32 contiguous, written in place; ``plugin_args``: the plugins'
        kernel arguments and the pack's (``runtime/packed.py: launch_args``: CuQ, CuK, DOCS, SEARCH_STEPS)."""
        _, Hq, total_q, _ = q.shape
        block_n = self.spec.tiles.block_n
        args = self.spec.launch.bind(
            {
                "q_desc": describe(q, ROWS.value),
                "k_desc": describe(k, block_n),
                "v_desc": describe(v, block_n),
                "o_desc": describe(out, ROWS.value),
                "Q": q,
                "K": k,
                "V": v,
                "Out": out,
                "Lse": out if lse is None else lse,
                "Nq": total_q,
                "N_K": k.shape[2],
                "HQ": Hq,
                "GROUP": Hq // k.shape[1],
                **self._scales,
                **plugin_args,
            }
        )
        TemplateForward.launches += 1
        TemplateForward.last_key = self.key
        self._launcher.launch(
            (Hq, self.blocks(total_q, plugin_args["DOCS"])),
            args,
            self.spec.launch.constexprs({"SAVE_LSE": lse is not None}),
            num_warps=4,
            device=q.device,
            maxnreg=LAUNCH_REGISTERS,
        )


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
    row_stride = padded_rows(total + block * docs, block)
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


class PackedTemplateDkdv(TemplateDkdv):
    """The dK/dV template's instance of a packed call (its launches count as ``TemplateDkdv``'s). A program has all
    of its GQA group's query heads (GROUP_SUM "none"): a split group's partial sums are laid out by key block of
    one sequence, not of a document."""

    @staticmethod
    def fits_documents(heads_q: int, total_q: int, total_k: int, docs: int) -> bool:
        """Whether one launch's grid holds a pack's key blocks and int32 TMA coordinates its rows of lse and delta
        (``document_rows``) (else the call runs the generated dK/dV kernel)."""
        rows = heads_q * padded_rows(total_q + ROWS.value * docs, ROWS.value)
        return PackedTemplateForward.fits_pack(total_k, docs) and rows < 2**31

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dout: torch.Tensor,
        lse: torch.Tensor | None,
        delta: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        plugin_args: dict[str, Any],
    ) -> None:
        """q and dout (1, Hq, total_q, D), k and v (1, Hkv, total_k, D) with total_q, total_k >= 1 (``fits``,
        ``fits_documents``); lse and delta (1, Hq, total_q) float32 as ``TemplateDkdv`` takes them -> dk, dv,
        written in place; ``plugin_args``: the plugins' kernel arguments and the pack's."""
        _, Hq, total_q, D = q.shape
        Hkv, total_k = k.shape[1], k.shape[2]
        lse_desc = delta_desc = None
        row_stride = 0  # no rows read: the normaliser saves no lse
        if self._has_lse:
            lse_rows, delta_rows, row_stride = document_rows(lse, delta, plugin_args["CuQ"], plugin_args["DOCS"])
            lse_desc, delta_desc = HopperLauncher._describe_rows(lse_rows), HopperLauncher._describe_rows(delta_rows)
        args = self.spec.launch.bind(
            {
                "q_desc": describe(q, ROWS.value),
                "do_desc": describe(dout, ROWS.value),
                "k_desc": describe(k, ROWS.value),
                "v_desc": describe(v, ROWS.value),
                "lse_desc": lse_desc,
                "delta_desc": delta_desc,
                "DKey": dk,
                "DValue": dv,
                "dk_part": dk,  # unread: GROUP_SUM "none"
                "dv_part": dv,
                "counts": dk,
                "part_size": 0,
                **dict(zip(("stride_dkb", "stride_dkh", "stride_dkn"), dk.stride())),
                **dict(zip(("stride_dvb", "stride_dvh", "stride_dvn"), dv.stride())),
                "Nq": total_q,
                "N_K": total_k,
                "HQ": Hq,
                "GROUP": Hq // Hkv,
                "heads": Hq // Hkv,
                "row_stride": row_stride,
                **self._scales,
                **plugin_args,
            }
        )
        TemplateDkdv.launches += 1
        TemplateDkdv.last_key = self.key
        self._launcher.launch(
            (Hkv, PackedTemplateForward.blocks(total_k, plugin_args["DOCS"])),
            args,
            self.spec.launch.constexprs({"GROUP_SUM": "none"}),
            num_warps=4,
            device=q.device,
            maxnreg=LAUNCH_REGISTERS,
        )
