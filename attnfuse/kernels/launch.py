"""Launching a template instance: TMA descriptors of the call's tensors, the plugins' arguments, one launch (the
forward's, or the dK/dV template's after the rows it reads)."""

from __future__ import annotations

from typing import Any

import torch

from ..plan import KernelSpec
from ..runtime.hopper import HopperLauncher, group_split
from ..runtime.launcher import Launcher, cdiv
from ..runtime.template_rows import padded_rows, template_rows
from ..runtime.source_cache import load_function, write_source
from .descriptors import describable, describe
from .pipeline import LAUNCH_REGISTERS, ROWS


class TemplateInstance:
    """One template instance of a plan (``spec``), loaded from its source; ``key`` names it in the record of
    verified instances; ``scale`` and ``qk_scale`` are launch arguments. Each kind's class counts its
    ``launches`` and keeps the ``last_key`` launched, which the GPU check (``verify.py``) reads."""

    launches = 0
    last_key: str | None = None

    def __init__(self, spec: KernelSpec, scale: float, qk_scale: float, key: str):
        self.spec = spec
        self.key = key
        self.source = spec.source
        self.path = write_source(spec.name, self.source)
        self._launcher = Launcher(load_function(self.source, spec.name, self.path))
        self._scales = {"sm_scale": scale, "qk_scale": qk_scale}


class TemplateForward(TemplateInstance):
    """The forward template's instance."""

    launches = 0
    last_key: str | None = None

    @staticmethod
    def fits(*tensors: torch.Tensor) -> bool:
        """Whether TMA can address every one of ``tensors`` (else the call runs the generated kernel)."""
        return all(describable(t) for t in tensors)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        plugin_args: dict[str, Any],
    ) -> None:
        """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Nq, Nk >= 1 -> out (B, Hq, Nq, D) and, if given, lse
        (B, Hq, Nq) float32 contiguous, written in place; ``plugin_args``: the plugins' kernel arguments."""
        B, Hq, Nq, _ = q.shape
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
                "Nq": Nq,
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
            (B * Hq, cdiv(Nq, 2 * ROWS.value)),
            args,
            self.spec.launch.constexprs({"SAVE_LSE": lse is not None}),
            num_warps=4,
            device=q.device,
            maxnreg=LAUNCH_REGISTERS,
        )


class TemplateDkdv(TemplateInstance):
    """The dK/dV template's instance; ``has_lse``: its normaliser saves lse."""

    launches = 0
    last_key: str | None = None

    def __init__(self, spec: KernelSpec, scale: float, qk_scale: float, key: str, has_lse: bool):
        super().__init__(spec, scale, qk_scale, key)
        self._has_lse = has_lse  # the normaliser saves lse: the instance reads its rows and delta's

    def fits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor | None,
             dk: torch.Tensor, dv: torch.Tensor) -> bool:  # fmt: skip
        """Whether the instance can run on these tensors: TMA addresses q, k, v and dout, the normaliser's lse
        is there when it reads one, its padded rows have int32 TMA coordinates, and dk and dv have unit last
        strides (else the call runs another dK/dV kernel)."""
        if self._has_lse and (lse is None or not HopperLauncher.rows_fit(lse)):
            return False
        return all(describable(t) for t in (q, k, v, dout)) and dk.stride(3) == dv.stride(3) == 1

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
        """q and dout (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Nq, Nk >= 1 (``fits``); lse (B, Hq, Nq) float32
        as the forward saved it (None when the normaliser saves none), delta (B, Hq, Nq) float32 as the dQ kernel
        wrote it -> dk, dv (k's and v's shapes), written in place; ``plugin_args``: the plugins' kernel
        arguments. A GQA group's query heads split over programs are summed as ``hopper.group_split`` says."""
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        lse_desc = delta_desc = None
        if self._has_lse:  # (an instance whose normaliser needs no delta reads no delta rows)
            lse_rows, delta_rows = template_rows(lse, ROWS.value, delta=delta, natural=True)
            lse_desc, delta_desc = HopperLauncher._describe_rows(lse_rows), HopperLauncher._describe_rows(delta_rows)
        parts, group_sum, dk_part, dv_part, counts = group_split(q, k, dk, dv)
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
                "dk_part": dk_part,
                "dv_part": dv_part,
                "counts": counts,
                "part_size": B * Hkv * Nk * D,
                **dict(zip(("stride_dkb", "stride_dkh", "stride_dkn"), dk.stride())),
                **dict(zip(("stride_dvb", "stride_dvh", "stride_dvn"), dv.stride())),
                "Nq": Nq,
                "N_K": Nk,
                "HQ": Hq,
                "GROUP": Hq // Hkv,
                "heads": Hq // Hkv // parts,
                "row_stride": padded_rows(Nq, ROWS.value),
                **self._scales,
                **plugin_args,
            }
        )
        TemplateDkdv.launches += 1
        TemplateDkdv.last_key = self.key
        self._launcher.launch(
            (B * Hkv * parts, cdiv(Nk, 2 * ROWS.value)),
            args,
            self.spec.launch.constexprs({"GROUP_SUM": group_sum}),
            num_warps=4,
            device=q.device,
            maxnreg=LAUNCH_REGISTERS,
        )
        if group_sum == "atomic":
            dk.copy_(dk_part)
            dv.copy_(dv_part)
