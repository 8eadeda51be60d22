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

CONFIGS = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 32, 4, 3),
         (128, 64, 8, 4), (64, 64, 4, 4)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
          (64, 128, 4, 3), (128, 128, 4, 3)],
}


class SweepPlugin:
    def __init__(self, config: TileConfig):
        self.config = config

    @af.hookimpl
    def attnfuse_tile_configs(self):
        return [TileRule(config=self.config)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="gpt2:4096:causal,llama3-8b:8192:causal,llama3-8b:8192:rope_causal,"
                                           "llama3-8b:8192:dense,gpt2:4096:rope_causal")
    args = parser.parse_args()
    for case in args.cases.split(","):
        geometry, N, variant = case.split(":")
        N = int(N)
        B, Hq, Hkv, D = GEOMETRIES[geometry]
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
        flops = 4 * B * Hq * pairs(variant, N) * D
        program = PROGRAMS[variant]
        results = []
        for bm, bn, warps, stages in CONFIGS[D]:
            config = TileConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            af.register_plugin(SweepPlugin(config), name="sweep")
            clear_cache()
            try:
                program(q, k, v)
                ms = do_bench(lambda: program(q, k, v), warmup=25, rep=100, return_mode="median")
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
