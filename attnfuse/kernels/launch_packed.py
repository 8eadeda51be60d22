"""Launching the forward template's instance of a packed call (cu_seqlens): the grid of the generated packed
kernels (``passes/codegen/packed.py``), total_q // 128 + docs query blocks for each query head, known with no host
sync; each program finds its document (``kernels/forward_facts.py``)."""

from __future__ import annotations

from typing import Any

import torch

from .descriptors import describe
from .launch import TemplateForward
from .pipeline import LAUNCH_REGISTERS, ROWS

GRID_Y_LIMIT = 65535  # the largest grid dim y of a CUDA launch


class PackedTemplateForward(TemplateForward):
    """The forward template's instance of a packed call (its launches count as ``TemplateForward``'s)."""

    @staticmethod
    def blocks(total_q: int, docs: int) -> int:
        """The query blocks of the grid of a pack of ``docs`` documents in ``total_q`` rows."""
        return total_q // (2 * ROWS.value) + docs

    @classmethod
    def fits_pack(cls, total_q: int, docs: int) -> bool:
        """Whether one launch's grid holds the pack's query blocks (else the call runs the generated kernel)."""
        return cls.blocks(total_q, docs) <= GRID_Y_LIMIT

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
