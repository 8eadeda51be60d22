"""The forward launcher: out (and lse) from q, k, v through one generated kernel, or on Hopper, for the
programs and tensors it serves, through the forward template's instance (``attnfuse/kernels``) where it is
chosen."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..kernels.capability import block_list_reason
from ..kernels.launch import TemplateForward
from ..kernels.launch_fp8 import Fp8TemplateForward
from ..kernels.launch_fp8_packed import PackedFp8TemplateForward
from ..kernels.launch_packed import PackedTemplateForward, fits_pack
from ..kernels.verified import chosen, record_key
from ..plan import Plan
from .inputs import KVCache, accumulator_dtype, empty_like_layout, even_keys, heads_together, kv_launch_args
from . import packed
from .kernel import CompiledKernel
from .dropout import launch_args as dropout_args
from .fp8 import FP8_DTYPES, Fp8, upcast_dtype
from .launcher import query_grid
from .plugin_args import PluginArgs, Prepared


def template_forward(plan: Plan) -> TemplateForward | None:
    """The forward template's instance of ``plan`` where the templates can run it and ``verified.chosen``
    chooses it (a GPU verified it, or ``ATTNFUSE_TEMPLATES=all``), else None; a packed call's instance launches its
    own grid (``PackedTemplateForward``), a float8 call's instance reads V transposed (``Fp8TemplateForward``; both:
    ``PackedFp8TemplateForward``)."""
    spec = plan.templates.kernels.get("forward")
    if spec is None:
        return None
    key = record_key(spec, plan.config.dtype, plan.config.head_dim)
    fp8 = plan.config.dtype in FP8_NAMES
    instance = TemplateForward
    if plan.config.varlen:
        instance = PackedFp8TemplateForward if fp8 else PackedTemplateForward
    elif fp8:
        instance = Fp8TemplateForward
    return instance(spec, plan.templates.scale, plan.templates.qk_scale, key) if chosen(key) else None


FP8_NAMES = frozenset(FP8_DTYPES.values())


def fp8_args(fp8: Fp8 | None) -> dict[str, torch.Tensor]:
    """A float8 forward's descale arguments by name (their strides come with them); none otherwise."""
    if fp8 is None:
        return {}
    return {"QDescale": fp8.q_descale, "KDescale": fp8.k_descale, "VDescale": fp8.v_descale}


class ForwardKernel:
    """The compiled forward kernel of one plan, and its launcher."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.kernel = CompiledKernel(plan.kernels["forward"], plan.config.arch == "interpreter")
        self.source = self.kernel.source
        self.path = self.kernel.path
        self.plugin_args = PluginArgs(plan)
        self.template = template_forward(plan)
        interpreted = plan.config.arch == "interpreter"
        self.fp8 = {"UPCAST_DTYPE": upcast_dtype(interpreted)} if plan.config.dtype in FP8_NAMES else {}

    def __call__(
        self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any], prepared: Prepared | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out (B, Hq, Nq, DV) in q's dtype (a float8 call's ``out_dtype``) and memory order; lse (B, Hq, Nq)
        float32 (float64 for float64 inputs) or None. ``prepared``: the plugin arguments, if the caller has
        them already. The template's instance runs where it is chosen, TMA addresses the tensors, a listing
        mask's block size is one it follows (``capability.block_list_reason``), a packed call's query blocks fit
        one grid (``launch_packed.fits_pack``) and a float8 call's out is bfloat16 (any, with
        ``ATTNFUSE_TEMPLATES=all``); else the generated kernel."""
        B, Hq, Nq, D = q.shape
        k, v, Nk, DV = kv.k, kv.v, kv.capacity, kv.v.shape[3]
        out = empty_like_layout(q, DV, q.dtype if kv.fp8 is None else kv.fp8.out_dtype)
        lse = (
            torch.empty((B, Hq, Nq), dtype=accumulator_dtype(q.dtype), device=q.device)
            if self.plan.config.save_lse
            else None
        )
        if out.numel() == 0:
            return out, lse
        if Nk == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
            return out, lse
        prepared = prepared or self.plugin_args(q, kv, inputs)
        pargs, limit, _ = prepared
        served = self.template is not None and self.template.fits(q, k, v, out) and block_list_reason(limit) is None
        if served and (kv.packed is None or fits_pack(Nq, kv.packed.docs)):
            launch_args = {**pargs, **kv_launch_args(kv), **dropout_args(kv.dropout), **fp8_args(kv.fp8)}
            self.template(q, k, v, out, lse, launch_args)
            return out, lse
        spec = self.kernel.spec
        args = spec.launch.bind(
            {
                "Q": q,
                "K": k,
                "V": v,
                "Out": out,
                "Lse": out if lse is None else lse,
                "HQ": Hq,
                "Nq": Nq,
                "HEAD_GROUP": heads_together(q, kv),
                **kv_launch_args(kv),
                **pargs,
                **fp8_args(kv.fp8),
            }
        )
        if kv.packed is not None:
            grid, even_m = packed.query_grid(Nq, kv.packed.docs, Hq), False
        else:
            grid, even_m = query_grid(Nq, B * Hq, limit if spec.scheduled else None), lambda t: Nq % t.block_m == 0
        self.kernel.launch(grid, args, q.device, limit=limit, EVEN_K=even_keys(kv), EVEN_M=even_m, **self.fp8)
        return out, lse
