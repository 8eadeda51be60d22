"""The Hopper dK/dV template's knobs (query rows per step, Q/dO stages, when a GQA grid splits its groups'
query heads and into how many parts), timed as GPU kernel time per Llama-3-8B forward+backward
(torch.profiler's sum of its kernels), with each kernel's share; and the backward's paths: dQ inside the
template (``fused``: ATTNFUSE_FUSED_DQ=1), the generated dQ kernel first (``separate``, the default), or that
under torch.use_deterministic_algorithms (``deterministic``: a split group's shares summed in order rather
than added atomically). ``--layout hf``: q, k, v and dO in
HF's (B, N, H, D) memory order, as a HuggingFace model's attention passes them.

    python benchmarks/sweep_hopper_dkdv.py [--N 2048 4096 8192] [--block-m 32 64] [--stages 2 3] [--split-waves 0 1 2]
        [--split-fill 1.5 3] [--paths fused separate deterministic] [--programs causal dense] [--layout hf] [--rounds 2]
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from attnfuse.bench.cases import GEOMETRIES, PROGRAMS
from attnfuse.runtime import hopper
from attnfuse.runtime.backward import FUSED_DQ_ENV
from profile_training import kernel_means


def tensor(B: int, H: int, N: int, D: int, layout: str) -> torch.Tensor:
    """A random (B, H, N, D) bfloat16 tensor on the GPU, in (B, H, N, D) or HF's (B, N, H, D) memory order."""
    if layout == "hf":
        return torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--block-m", type=int, nargs="+", default=[hopper.DKDV_BLOCK_M])
    parser.add_argument("--stages", type=int, nargs="+", default=[hopper.DKDV_STAGES])
    parser.add_argument("--split-waves", type=float, nargs="+", default=[hopper.DKDV_SPLIT_WAVES])
    parser.add_argument("--split-fill", type=float, nargs="+", default=[hopper.DKDV_SPLIT_FILL])
    parser.add_argument("--paths", nargs="+", default=["fused"], choices=["fused", "separate", "deterministic"])
    parser.add_argument("--programs", nargs="+", default=["causal"], choices=["causal", "dense"])
    parser.add_argument("--layout", default="bhnd", choices=["bhnd", "hf"], help="the tensors' memory order")
    parser.add_argument("--rounds", type=int, default=1, help="times each setting is timed, in turns")
    args = parser.parse_args()
    B, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    for program, N in itertools.product(args.programs, args.N):
        leaves = [tensor(B, h, N, D, args.layout).requires_grad_() for h in (Hq, Hkv, Hkv)]
        dout = tensor(B, Hq, N, D, args.layout)
        settings = list(itertools.product(args.block_m, args.stages, args.split_waves, args.split_fill, args.paths))
        for _, (block_m, stages, waves, fill, path) in itertools.product(range(args.rounds), settings):
            hopper.DKDV_BLOCK_M, hopper.DKDV_STAGES = block_m, stages
            hopper.DKDV_SPLIT_WAVES, hopper.DKDV_SPLIT_FILL = waves, fill
            torch.use_deterministic_algorithms(path == "deterministic")
            os.environ[FUSED_DQ_ENV] = "1" if path == "fused" else "0"
            try:
                rows = kernel_means(lambda: torch.autograd.grad(PROGRAMS[program](*leaves), leaves, dout))
            finally:
                torch.use_deterministic_algorithms(False)
                os.environ.pop(FUSED_DQ_ENV)
            parts = ", ".join(f"{key[:24]} {t:.1f}" for t, key in rows[:6])
            print(
                f"{program} N {N} block_m {block_m} stages {stages} split_waves {waves} split_fill {fill} {path}: "
                f"{sum(t for t, _ in rows):.1f} us ({parts})",
                flush=True,
            )


if __name__ == "__main__":
    main()
