"""Launching a template instance: TMA descriptors of the call's tensors, the plugins' arguments, one launch."""

from __future__ import annotations

from typing import Any

import torch

from ..plan import KernelSpec
from ..runtime.launcher import Launcher, cdiv
from ..runtime.source_cache import load_function, write_source
from .descriptors import describable, describe
from .pipeline import LAUNCH_REGISTERS, ROWS


class TemplateForward:
    """The forward template's instance of one plan (``spec``), loaded from its source; ``key`` names it in the
    record of verified instances. ``launches`` and ``last_key`` (of the class): how many launches this process
    made, and the instance of the latest, which the GPU check (``verify.py``) reads."""

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
