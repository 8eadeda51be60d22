"""Tile sweep for the forward kernel: block sizes, warps and stages, through the plugin tile-rule hook.

    python benchmarks/sweep_tiles.py [--cases gpt2:4096:causal,llama3-8b:8192:causal,...]

Prints the median ms of each configuration per case and the best; the winners go in attnfuse/passes/tile.py.
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import attnfuse as af
from attnfuse.passes.tile import TileConfig, TileRule
from attnfuse.runtime.launch import clear_cache
from bench_attention import GEOMETRIES, PROGRAMS, pairs

BACKWARD_CONFIGS = {  # per head dim: (BLOCK_M, BLOCK_N, warps, stages) for the kernel swept
    "dkdv": {64: [(32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (16, 128, 4, 3)],
             128: [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (16, 64, 4, 3), (32, 128, 4, 2)]},
    "dq": {64: [(128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
           128: [(128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)]},
}
CONFIGS = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 32, 4, 3),
         (128, 64, 8, 4), (64, 64, 4, 4)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
          (64, 128, 4, 3), (128, 128, 4, 3)],
}


class SweepPlugin:
    def __init__(self, config: TileConfig, kernel: str):
        self.config = config
        self.kernel = kernel

    @af.hookimpl
    def attnfuse_tile_configs(self):
        return [TileRule(config=self.config, kernel=self.kernel)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="gpt2:4096:causal,llama3-8b:8192:causal,llama3-8b:8192:rope_causal,"
                                           "llama3-8b:8192:dense,gpt2:4096:rope_causal")
    parser.add_argument("--kernel", default="forward", choices=["forward", "dkdv", "dq"],
                        help="the kernel whose tiles are swept (dkdv and dq time forward+backward)")
    args = parser.parse_args()
    for case in args.cases.split(","):
        geometry, N, variant = case.split(":")
        N = int(N)
        B, Hq, Hkv, D = GEOMETRIES[geometry]
        training = args.kernel != "forward"
        q, k, v = (torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=training)
                   for h in (Hq, Hkv, Hkv))
        flops = (3.5 if training else 1.0) * 4 * B * Hq * pairs(variant, N) * D
        program = PROGRAMS[variant]

        def step():
            out = program(q, k, v)
            return torch.autograd.grad(out, (q, k, v), out) if training else out
        results = []
        for bm, bn, warps, stages in (BACKWARD_CONFIGS[args.kernel][D] if training else CONFIGS[D]):
            config = TileConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            af.register_plugin(SweepPlugin(config, args.kernel), name="sweep")
            clear_cache()
            try:
                step()
                ms = do_bench(step, warmup=25, rep=100, return_mode="median")
                results.append((ms, (bm, bn, warps, stages)))
                print(f"{case} BM{bm} BN{bn} w{warps} s{stages}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s",
                      flush=True)
            except Exception as exc:  # out of shared memory, etc.
                print(f"{case} BM{bm} BN{bn} w{warps} s{stages}: failed ({str(exc).splitlines()[0][:80]})")
            finally:
                af.unregister_plugin("sweep")
        best = min(results)
        print(f"BEST {case}: {best[1]} {best[0]:.3f} ms {flops / best[0] / 1e9:.0f} TFLOP/s", flush=True)
    clear_cache()


if __name__ == "__main__":
    main()
