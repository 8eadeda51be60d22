"""Launching the dQ template's instance: TMA descriptors of the call's tensors, the plugins' arguments, one
launch, which writes dQ and each row's delta (the dK/dV kernel that runs next reads it); a packed call's instance
launches the packed forward's grid (``PackedTemplateDq``)."""

from __future__ import annotations

from typing import Any

import torch

from ..plan import KernelSpec
from .descriptors import describable, describe
from .launch import TemplateInstance
from .launch_packed import PackedGrid
from .pipeline import ROWS


class TemplateDq(TemplateInstance):
    """The dQ template's instance; ``has_lse``: its normaliser saves lse (the instance reads it)."""

    launches = 0
    last_key: str | None = None

    def __init__(self, spec: KernelSpec, scale: float, qk_scale: float, key: str, has_lse: bool):
        super().__init__(spec, scale, qk_scale, key)
        self._has_lse = has_lse

    def fits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
             lse: torch.Tensor | None, dq: torch.Tensor) -> bool:  # fmt: skip
        """Whether the instance can run on these tensors: TMA addresses q, k, v, out and dout, the normaliser's
        lse is there when it reads one, and dq has a unit last stride (else the call runs the generated dQ
        kernel)."""
        if self._has_lse and lse is None:
            return False
        return all(describable(t) for t in (q, k, v, out, dout)) and dq.stride(3) == 1

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        dout: torch.Tensor,
        lse: torch.Tensor | None,
        dlse: torch.Tensor | None,
        delta: torch.Tensor,
        dq: torch.Tensor,
        plugin_args: dict[str, Any],
    ) -> None:
        """q, out and dout (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Nq, Nk >= 1 (``fits``); lse (B, Hq, Nq)
        float32 contiguous as the forward saved it (None when the normaliser saves none); dlse (B, Hq, Nq) float32
        contiguous, or None -> dq (q's shape) and delta (B, Hq, Nq) float32 contiguous, written in place (delta
        where the normaliser reads it); ``plugin_args``: the plugins' kernel arguments."""
        B, Hq, Nq, _ = q.shape
        block_n = self.spec.tiles.block_n
        args = self.spec.launch.bind(
            {
                "q_desc": describe(q, ROWS.value),
                "do_desc": describe(dout, ROWS.value),
                "k_desc": describe(k, block_n),
                "v_desc": describe(v, block_n),
                "o_desc": describe(out, ROWS.value),
                "O": out,
                "Lse": delta if lse is None else lse,  # a placeholder when the normaliser saves none
                "DLse": delta if dlse is None else dlse,
                "Delta": delta,
                "DQuery": dq,
                **dict(zip(("stride_dqb", "stride_dqh", "stride_dqm"), dq.stride())),
                "Nq": Nq,
                "N_K": k.shape[2],
                "HQ": Hq,
                "GROUP": Hq // k.shape[1],
                **self._scales,
                **plugin_args,
            }
        )
        constexprs = self.spec.launch.constexprs({"HAS_DLSE": dlse is not None})
        self._launch(TemplateDq, (B * Hq, self.blocks(Nq, plugin_args)), args, constexprs, q.device)


class PackedTemplateDq(PackedGrid, TemplateDq):
    """The dQ template's instance of a packed call, q (1, Hq, total_q, D) (its launches count as ``TemplateDq``'s):
    the packed forward's grid, whose programs find their documents."""
