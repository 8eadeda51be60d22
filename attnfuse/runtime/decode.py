"""The split-KV decoding launcher: phase one (generated kernel) over key splits, phase two (combine)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..plan import Plan
from .combine import combine
from .inputs import KVCache, accumulator_dtype, empty_like_layout, even_keys, kv_launch_args
from .kernel import CompiledKernel
from .plugin_args import PluginArgs
from .launcher import cdiv, head_grid, multiprocessors, next_power_of_2

MAX_QUERIES = 16  # decoding and speculative decoding: at most this many queries take the split path
PROGRAMS_PER_SM = 2  # split-KV programs to have in flight per multiprocessor (benchmarks/sweep_tiles.py)


def _parallelism(device: torch.device) -> int:
    """Programs worth having in flight: PROGRAMS_PER_SM per multiprocessor on a GPU; a few under the
    interpreter."""
    return PROGRAMS_PER_SM * multiprocessors(device) if device.type == "cuda" else 4


def split_plan(B: int, Hkv: int, row_blocks: int, capacity: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(keys per split, number of splits): enough programs to fill the GPU, each split whole blocks."""
    blocks = cdiv(capacity, block_n)
    splits = max(1, min(blocks, cdiv(_parallelism(device), B * Hkv * row_blocks)))
    split_keys = cdiv(blocks, splits) * block_n
    return split_keys, cdiv(capacity, split_keys)


class DecodeKernel:
    """The split-KV kernel of one plan, and its two-phase launcher."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.kernel = CompiledKernel(plan.kernels["decode"], plan.config.arch == "interpreter")
        self.source = self.kernel.source
        self.plugin_args = PluginArgs(plan)
        self._logsumexp = plan.combine == "logsumexp"

    def __call__(
        self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out (B, Hq, Nq, DV); lse (B, Hq, Nq) when the configuration saves it."""
        config = self.plan.config
        B, Hq, Nq, D = q.shape
        Hkv, DV = kv.k.shape[1], kv.v.shape[3]
        acc = accumulator_dtype(q.dtype)
        out = empty_like_layout(q, DV, q.dtype)
        lse = torch.empty((B, Hq, Nq), dtype=acc, device=q.device) if config.save_lse else None
        if out.numel() == 0 or kv.capacity == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
            return out, lse
        rows = config.group * Nq
        block_m = min(self.kernel.tiles.block_m, max(16, next_power_of_2(rows)))
        row_blocks = cdiv(rows, block_m)
        split_keys, splits = split_plan(B, Hkv, row_blocks, kv.capacity, self.kernel.tiles.block_n, q.device)
        part_out = torch.empty((B * Hq * Nq, splits, DV), dtype=acc, device=q.device)
        part_lse = torch.empty((B * Hq * Nq, splits), dtype=acc, device=q.device)
        args = self.kernel.spec.launch.bind(
            {
                "Q": q,
                "K": kv.k,
                "V": kv.v,
                "PartOut": part_out,
                "PartLse": part_lse,
                "HQ": Hq,
                "Nq": Nq,
                **kv_launch_args(kv),
                "SPLIT": split_keys,
                "NUM_SPLITS": splits,
                **self.plugin_args(q, kv, inputs).args,
            }
        )
        y, z = head_grid(B * Hkv, "B x Hkv")  # z > 1 only past 65535 heads: z * row_blocks stays small
        self.kernel.launch(
            lambda tiles: (splits, y, z * row_blocks), args, q.device, block_m=block_m, EVEN_K=even_keys(kv)
        )
        combine(part_out, part_lse, out, lse, self._logsumexp)
        return out, lse
