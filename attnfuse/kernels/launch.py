"""Launching a template instance: TMA descriptors of the call's tensors, the plugins' arguments, one launch (the
forward's, or the dK/dV template's after the rows it reads)."""

from __future__ import annotations

from typing import Any

import torch

from ..plan import KernelSpec
from ..runtime.hopper import describe_rows, group_split, lse_rows_fit
from ..runtime.launcher import Launcher, cdiv
from ..runtime.template_rows import padded_rows, template_rows
from ..runtime.source_cache import load_function, write_source
from .descriptors import describable, describe
from .pipeline import LAUNCH_REGISTERS, ROWS


class TemplateInstance:
    """One template instance of a plan (``spec``), loaded from its source; ``key`` names it in the record of
    verified instances; ``scale`` and ``qk_scale`` are launch arguments. Each kind's class counts its
    ``launches`` and keeps the ``last_key`` launched, which the GPU check (``verify.py``) reads. What differs
    between calls of one kind (a packed call's grid, a float8 call's operands) are hooks its subclasses
    override: ``blocks`` here, ``operands`` (forward), ``rows`` and ``split`` (dK/dV)."""

    launches = 0
    last_key: str | None = None

    def __init__(self, spec: KernelSpec, scale: float, qk_scale: float, key: str):
        self.spec = spec
        self.key = key
        self.source = spec.source
        self.path = write_source(spec.name, self.source)
        self._launcher = Launcher(load_function(self.source, spec.name, self.path))
        self._scales = {"sm_scale": scale, "qk_scale": qk_scale}

    @staticmethod
    def blocks(rows: int, plugin_args: dict[str, Any]) -> int:
        """The grid's programs along a sequence of ``rows`` queries (forward, dQ) or keys (dK/dV): one per
        2 x 64 rows."""
        return cdiv(rows, 2 * ROWS.value)

    def _launch(self, kind: type, grid: tuple[int, int], args: list, constexprs: list, device: torch.device) -> None:
        """One launch of the instance, counted as ``kind``'s (its subclasses' launches count as their kind's)."""
        kind.launches += 1
        kind.last_key = self.key
        self._launcher.launch(grid, args, constexprs, num_warps=4, device=device, maxnreg=LAUNCH_REGISTERS)


class TemplateForward(TemplateInstance):
    """The forward template's instance."""

    launches = 0
    last_key: str | None = None

    @staticmethod
    def fits(*tensors: torch.Tensor) -> bool:
        """Whether TMA can address every one of ``tensors`` (else the call runs the generated kernel)."""
        return all(describable(t) for t in tensors)

    def operands(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
        """The instance's arguments that read q, k and v: their TMA descriptors and the tensors."""
        block_n = self.spec.tiles.block_n
        return {
            "q_desc": describe(q, ROWS.value),
            "k_desc": describe(k, block_n),
            "v_desc": describe(v, block_n),
            "Q": q,
            "K": k,
            "V": v,
        }

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
        args = self.spec.launch.bind(
            {
                **self.operands(q, k, v),
                "o_desc": describe(out, ROWS.value),
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
        constexprs = self.spec.launch.constexprs({"SAVE_LSE": lse is not None})
        self._launch(TemplateForward, (B * Hq, self.blocks(Nq, plugin_args)), args, constexprs, q.device)


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
        if self._has_lse and (lse is None or not lse_rows_fit(lse)):
            return False
        return all(describable(t) for t in (q, k, v, dout)) and dk.stride(3) == dv.stride(3) == 1

    @staticmethod
    def rows(
        lse: torch.Tensor, delta: torch.Tensor, plugin_args: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """lse (natural, as saved) and delta (B, Hq, Nq) float32 -> the rows the instance reads, float32
        (``template_rows``), and each (batch, head)'s row stride in them."""
        lse_rows, delta_rows = template_rows(lse, ROWS.value, delta=delta, natural=True)
        return lse_rows, delta_rows, padded_rows(lse.shape[2], ROWS.value)

    @staticmethod
    def split(
        q: torch.Tensor, k: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
    ) -> tuple[int, str, torch.Tensor, torch.Tensor, torch.Tensor]:
        """How the launch sums a GQA group's query heads (``hopper.group_split``)."""
        return group_split(q, k, dk, dv)

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
        arguments. A GQA group's query heads split over programs are summed as ``split`` says."""
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        lse_desc = delta_desc = None
        row_stride = 0  # no rows read: the normaliser saves no lse
        if self._has_lse:  # (an instance whose normaliser needs no delta reads no delta rows)
            lse_rows, delta_rows, row_stride = self.rows(lse, delta, plugin_args)
            lse_desc, delta_desc = describe_rows(lse_rows), describe_rows(delta_rows)
        parts, group_sum, dk_part, dv_part, counts = self.split(q, k, dk, dv)
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
                "row_stride": row_stride,
                **self._scales,
                **plugin_args,
            }
        )
        constexprs = self.spec.launch.constexprs({"GROUP_SUM": group_sum})
        self._launch(TemplateDkdv, (B * Hkv * parts, self.blocks(Nk, plugin_args)), args, constexprs, q.device)
        if group_sum == "atomic":
            dk.copy_(dk_part)
            dv.copy_(dv_part)
