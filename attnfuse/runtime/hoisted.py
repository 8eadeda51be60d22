"""The forward with the keys' qk transforms hoisted: a key pass, then a forward that reads its output.

Fused, the forward transforms every key tile once per query block that visits it: Nq / BLOCK_M times
over the whole call. Hoisted, each key is transformed once (one more launch and a scratch copy of K).
The runtime hoists when at least ``HOIST_MIN_QUERY_BLOCKS`` query blocks would each transform the keys.
"""
from __future__ import annotations

from typing import Any

import attrs
import torch

from ..passes.codegen import generate_key_pass
from ..passes.lower import TiledKernel
from .forward import ForwardKernel
from .inputs import KVCache
from .kernel import CompiledKernel
from .launcher import cdiv

HOIST_MIN_QUERY_BLOCKS = 4  # benchmarks/bench_attention.py times both ways (the rope_causal_per_tile rows)


def hoistable(tiled: TiledKernel) -> bool:
    """Whether a program's keys have transforms the key pass can apply (contiguous keys, one length)."""
    return (any(t.fragment.k for t in tiled.transforms) and not tiled.config.kv_lens and not tiled.config.paged
            and not tiled.config.k_transformed)


def worth_hoisting(forward: ForwardKernel, Nq: int) -> bool:
    return hoistable(forward.tiled) and cdiv(Nq, forward.kernel.tiles.block_m) >= HOIST_MIN_QUERY_BLOCKS


class HoistedForward:
    """``fused``'s program as a key pass plus ``main``, the same program's forward for transformed keys.

    ``tiled`` is the fused kernel's, which the backward (fused as ever) is generated from.
    """

    def __init__(self, fused: ForwardKernel, main: ForwardKernel):
        self.tiled = fused.tiled
        self.main = main
        self.key_pass = CompiledKernel(fused.tiled.name.replace("_fwd_", "_keys_"), generate_key_pass(fused.tiled),
                                       fused.tiled.config.arch == "interpreter", fused.tiled.tiles)
        self.source = self.key_pass.source
        self.plugin_args = fused.plugin_args
        self.constexprs = fused.constexprs

    def __call__(self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``ForwardKernel.__call__``."""
        k = kv.k
        B, Hkv, Nk, D = k.shape
        if q.numel() == 0 or k.numel() == 0:
            return self.main(q, kv, inputs)
        keys = torch.empty((B, Hkv, Nk, D), dtype=k.dtype, device=k.device)
        pargs, _ = self.plugin_args(q, kv, inputs)
        self.key_pass.launch(lambda tiles: (cdiv(Nk, tiles.block_n), B * Hkv),
                             (k, keys, *k.stride(), *keys.stride(), q.shape[1], q.shape[2], Nk, *pargs), q.device,
                             **self.constexprs)
        return self.main(q, attrs.evolve(kv, k=keys), inputs)
