"""The forward launcher: out (and lse) from q, k, v through one generated kernel."""
from __future__ import annotations

import math
from typing import Any

import torch

from ..passes.codegen import generate_forward
from ..passes.codegen.common import scheduled, split
from ..passes.lower import TiledKernel
from .inputs import (KVCache, PluginArgs, Prepared, accumulator_dtype, empty_like_layout, even_keys,
                     kv_launch_args)
from .kernel import CompiledKernel
from .launcher import block_grid


class ForwardKernel:
    """One compiled forward kernel and its launcher."""

    def __init__(self, tiled: TiledKernel):
        self.tiled = tiled
        self.kernel = CompiledKernel(tiled.name, generate_forward(tiled), tiled.config.arch == "interpreter",
                                     tiled.tiles)
        self.source = self.kernel.source
        self.path = self.kernel.path
        self.plugin_args = PluginArgs(tiled)
        self.constexprs = constexprs(tiled)
        self.scheduled = scheduled(tiled)

    def __call__(self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any],
                 prepared: Prepared | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out (B, Hq, Nq, DV) in q's dtype and memory order; lse (B, Hq, Nq) float32 (float64 for float64
        inputs) or None. ``prepared``: the plugin arguments, if the caller has them already."""
        t = self.tiled
        B, Hq, Nq, D = q.shape
        k, v, Nk, DV = kv.k, kv.v, kv.capacity, kv.v.shape[3]
        out = empty_like_layout(q, DV, q.dtype)
        lse = torch.empty((B, Hq, Nq), dtype=accumulator_dtype(q.dtype), device=q.device) \
            if t.config.save_lse else None
        if out.numel() == 0:
            return out, lse
        if Nk == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
            return out, lse
        pargs, limit, _ = prepared or self.plugin_args(q, kv, inputs)
        args = (q, k, v, out, out if lse is None else lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                Hq, Nq, *kv_launch_args(kv), *pargs)
        self.kernel.launch(block_grid(Nq, B * Hq, "block_m", limit if self.scheduled else None), args, q.device,
                           limit=limit, EVEN_K=even_keys(kv), EVEN_M=lambda tiles: Nq % tiles.block_m == 0,
                           **self.constexprs)
        return out, lse


def constexprs(t: TiledKernel) -> dict[str, int]:
    """The compile-time constants every generated kernel takes besides its tile sizes."""
    values = dict(GROUP=t.config.group, D=t.config.head_dim, DV=t.config.head_dim_v, BLOCK_D=t.block_d,
                  BLOCK_DV=t.block_dv)
    if split(t):
        values.update(HALF=t.config.head_dim // 2, BLOCK_H=t.block_h)
    return values
