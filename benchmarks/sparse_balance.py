"""Where a block-sparse training step's time goes, kernel by kernel: BigBird (band, random and global
blocks) against a mask of about the same density with no global blocks, Llama-3-8B geometry, bf16.

    python benchmarks/sparse_balance.py [--N 4096,16384]

Each kernel's mean time (torch.profiler) and TFLOP/s over the blocks it visits: a kernel that is slower
per FLOP with global blocks than without is held up by its few long programs, not by its tiles.
"""

from __future__ import annotations

import argparse

import torch

import attnfuse as af
from attnfuse.bench.cases import GEOMETRIES, bigbird_blocks, bigbird_program
from profile_training import kernel_means

PRODUCTS = {"fwd": 1.0, "dq": 1.5, "dkdv": 2.0}  # matrix products per tile, relative to the forward's two


def kernel_table(name: str, active: torch.Tensor, N: int, calls: int = 10) -> None:
    B, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    mask = af.BlockMask.from_blocks(active, N, N)
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)

    def step():
        return torch.autograd.grad(bigbird_program(*leaves, mask), leaves, dout)

    forward_flops = 4 * int(active.sum().item()) * mask.block_size**2 * D
    for us, key in kernel_means(step, calls):
        if key.startswith("attnfuse"):
            kind = key.split("_")[1]
            print(
                f"N{N} {name} {mask.sparsity():.0%} sparse {kind}: {us:.1f} us "
                f"{PRODUCTS[kind] * forward_flops / us / 1e6:.0f} TFLOP/s",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", default="4096,16384")
    args = parser.parse_args()
    B, Hq, _, _ = GEOMETRIES["llama3-8b"]
    for N in (int(n) for n in args.N.split(",")):
        kernel_table("bigbird", bigbird_blocks(B, Hq, N), N)
        # a band of ±1 blocks and 5 random blocks per query block: BigBird's density, no global blocks
        kernel_table("band+random", bigbird_blocks(B, Hq, N, randoms=5, global_blocks=0), N)


if __name__ == "__main__":
    main()
