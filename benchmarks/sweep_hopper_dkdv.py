"""The Hopper dK/dV template's knobs (query rows per step, Q/dO stages, when a GQA grid splits over query
heads), timed as GPU kernel time per Llama-3-8B causal forward+backward (torch.profiler's sum of its
kernels), with each kernel's share.

    python benchmarks/sweep_hopper_dkdv.py [--N 2048 4096 8192] [--block-m 32 64] [--stages 2 3] [--split-waves 0 1 2]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from attnfuse.bench.cases import GEOMETRIES, PROGRAMS
from attnfuse.runtime import hopper
from profile_training import kernel_means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--block-m", type=int, nargs="+", default=[hopper.DKDV_BLOCK_M])
    parser.add_argument("--stages", type=int, nargs="+", default=[hopper.DKDV_STAGES])
    parser.add_argument("--split-waves", type=float, nargs="+", default=[hopper.DKDV_SPLIT_WAVES])
    args = parser.parse_args()
    B, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    for N in args.N:
        leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for h in (Hq, Hkv, Hkv)]
        dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
        for block_m, stages, waves in itertools.product(args.block_m, args.stages, args.split_waves):
            hopper.DKDV_BLOCK_M, hopper.DKDV_STAGES, hopper.DKDV_SPLIT_WAVES = block_m, stages, waves
            rows = kernel_means(lambda: torch.autograd.grad(PROGRAMS["causal"](*leaves), leaves, dout))
            parts = ", ".join(f"{key[:24]} {t:.1f}" for t, key in rows[:5])
            print(f"N {N} block_m {block_m} stages {stages} split_waves {waves}: "
                  f"{sum(t for t, _ in rows):.1f} us ({parts})", flush=True)


if __name__ == "__main__":
    main()
