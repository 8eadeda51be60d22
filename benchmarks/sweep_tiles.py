"""Tile sweep: block sizes, warps and stages, through the plugin tile-rule hook.

    python benchmarks/sweep_tiles.py [--kernel forward|backward] [--cases gpt2:4096:causal,llama3-8b:8192:causal,...]
    python benchmarks/sweep_tiles.py --kernel backward --split-per-sm 0 2 4 8 [--dkdv-tiles ...] [--cases ...]
    python benchmarks/sweep_tiles.py --kernel decode [--cases llama3-70b:1,llama3-8b:8,...]
    python benchmarks/sweep_tiles.py --fp8 [--cases llama3-8b:8192:causal,...]   (the float8 forward's tiles)
    python benchmarks/sweep_tiles.py --float32 [--kernel backward] [--tiles ...]   (float32 calls' tiles)

Prints the median ms of each configuration per case and the best; the winners go in attnfuse/passes/tile.py
(decode: also the split count, attnfuse.runtime.decode.PROGRAMS_PER_SM; backward: the GQA dK/dV grid size
under which key blocks split, attnfuse.runtime.backward.SPLIT_PROGRAMS_PER_SM). Decode cases are timed from CUDA
graph replays, so host time does not hide the kernels'.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench, do_bench_cudagraph

import attnfuse as af
from attnfuse.passes.tile import TileConfig, TileRule
from attnfuse.runtime import backward, decode
from attnfuse.bench.suites import quantised
from attnfuse.bench.cases import (
    DECODE_MODELS,
    GEOMETRIES,
    PROGRAMS,
    bigbird_blocks,
    bigbird_program,
    decode_program,
    pairs,
)
from attnfuse.runtime.launch import clear_cache
from profile_training import kernel_means

BACKWARD_CONFIGS = {  # per head dim: (BLOCK_M, BLOCK_N, warps, stages) of dK/dV, then of dQ; pairs swept
    "dkdv": {
        64: [(64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3)],
        128: [(64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 3)],
    },
    "dq": {64: [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)], 128: [(128, 64, 8, 3)]},
}
DECODE_CONFIGS = [
    (16, bn, warps, stages, per_sm)  # and split-KV programs per multiprocessor
    for bn, warps in ((64, 4), (128, 4), (128, 8))
    for stages in (2, 3, 4)
    for per_sm in (2, 4, 8)
]
CONFIGS = {
    64: [
        (64, 64, 4, 3),
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (64, 128, 4, 3),
        (128, 32, 4, 3),
        (128, 64, 8, 4),
        (64, 64, 4, 4),
    ],
    128: [
        (128, 128, 8, 3),
        (128, 64, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (64, 128, 4, 3),
        (128, 128, 4, 3),
    ],
}


class SweepPlugin:
    def __init__(self, rules: list[TileRule]):
        self.rules = rules

    @af.hookimpl
    def attnfuse_tile_configs(self):
        return self.rules


def tiles(bm: int, bn: int, warps: int, stages: int) -> TileConfig:
    return TileConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)


def sweep(case: str, kernel: str, configs, step, amount: float, unit: str, timer=None) -> None:
    """Time ``step`` under each config: tiles (and for decode the programs per multiprocessor), or for
    ``kernel`` "backward" a (dK/dV tiles, dQ tiles) pair."""
    results = []
    for config in configs:
        if kernel == "backward":
            dkdv, dq = config
            rules = [TileRule(config=tiles(*dkdv), kernel="dkdv"), TileRule(config=tiles(*dq), kernel="dq")]
            label = (
                f"{case} dK/dV BM{dkdv[0]} BN{dkdv[1]} w{dkdv[2]} s{dkdv[3]}, dQ BM{dq[0]} BN{dq[1]} w{dq[2]} s{dq[3]}"
            )
        else:
            bm, bn, warps, stages, *per_sm = config
            rules = [TileRule(config=tiles(bm, bn, warps, stages), kernel=kernel)]
            if per_sm:
                decode.PROGRAMS_PER_SM = per_sm[0]
            label = f"{case} BM{bm} BN{bn} w{warps} s{stages}" + (f" {per_sm[0]}/SM" if per_sm else "")
        af.register_plugin(SweepPlugin(rules), name="sweep")
        clear_cache()
        try:
            step()
            ms = (timer or (lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")))(step)
            results.append((ms, label))
            print(f"{label}: {ms:.4f} ms {amount / ms / 1e9:.0f} {unit}", flush=True)
        except Exception as exc:  # out of shared memory, etc.
            print(f"{label}: failed ({str(exc).splitlines()[0][:80]})")
        finally:
            af.unregister_plugin("sweep")
    best = min(results)
    print(f"BEST {best[1]}: {best[0]:.4f} ms {amount / best[0] / 1e9:.0f} {unit}", flush=True)


def kernel_time(fn) -> float:
    """ms of GPU kernel time per call of ``fn``: the sum of its kernels' times under torch.profiler, which
    the host's speed does not change."""
    return sum(us for us, _ in kernel_means(fn, calls=20)) / 1e3


def sweep_decode(cases: str) -> None:
    for case in cases.split(","):
        model, B = case.split(":")
        Hq, Hkv, D, N = DECODE_MODELS[model]
        q = torch.randn(int(B), Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(int(B), Hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sweep(
            case,
            "decode",
            DECODE_CONFIGS,
            lambda: decode_program(q, k, v),
            2 * k.numel() * 2 * 1e3,
            "GB/s",
            timer=lambda fn: do_bench_cudagraph(fn, rep=100, return_mode="median"),
        )
    decode.PROGRAMS_PER_SM = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--cases",
        help="forward/backward: geometry:N:variant,... (variant: an attnfuse.bench.cases "
        "program or bigbird); decode: model:B,... "
        "(defaults: the cases the tile table was swept on)",
    )
    parser.add_argument(
        "--kernel",
        default="forward",
        choices=["forward", "backward", "decode"],
        help="the kernel whose tiles are swept (backward: pairs of dK/dV and dQ tiles, timing forward+backward)",
    )
    parser.add_argument(
        "--dkdv-tiles",
        nargs="+",
        help="backward: BLOCK_M,BLOCK_N,warps,stages of dK/dV to sweep (default: BACKWARD_CONFIGS)",
    )
    parser.add_argument("--dq-tiles", nargs="+", help="backward: the same for dQ")
    parser.add_argument("--tiles", nargs="+", help="forward: BLOCK_M,BLOCK_N,warps,stages to sweep (default: CONFIGS)")
    parser.add_argument(
        "--gpu-time",
        action="store_true",
        help="time the kernels alone (torch.profiler's sum "
        "of kernel times per step), not do_bench's wall time: small steps are host-bound",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="forward: float8 (e4m3) q, k, v with per-(batch, kv head) descales, as `attnfuse bench --suite fp8`",
    )
    parser.add_argument(
        "--split-per-sm",
        nargs="+",
        type=int,
        help="backward: values of attnfuse.runtime.backward.SPLIT_PROGRAMS_PER_SM to sweep too (0: no split)",
    )
    parser.add_argument(
        "--float32",
        action="store_true",
        help="forward or backward: float32 q, k, v (IEEE dots on the FMA units), not bfloat16",
    )
    args = parser.parse_args()
    if args.fp8 and args.float32:
        parser.error("--fp8 and --float32 name two input dtypes: choose one")
    if args.fp8 and args.kernel != "forward":
        parser.error("--fp8 sweeps the forward kernel's tiles: float8 calls have no backward and no split-KV path")
    if args.tiles:
        for D in CONFIGS:
            CONFIGS[D] = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    for kind, chosen in (("dkdv", args.dkdv_tiles), ("dq", args.dq_tiles)):
        for D in BACKWARD_CONFIGS[kind] if chosen else ():
            BACKWARD_CONFIGS[kind][D] = [tuple(int(x) for x in t.split(",")) for t in chosen]
    if args.kernel == "decode":
        sweep_decode(args.cases or "llama3-8b:1,llama3-70b:1,llama3-8b:8")
        clear_cache()
        return
    cases = args.cases or (
        "gpt2:4096:causal,llama3-8b:8192:causal,llama3-8b:8192:rope_causal,llama3-8b:8192:dense,gpt2:4096:rope_causal"
    )
    dtype = torch.float32 if args.float32 else torch.bfloat16
    for case in cases.split(","):
        geometry, N, variant = case.split(":")
        N = int(N)
        B, Hq, Hkv, D = GEOMETRIES[geometry]
        training = args.kernel != "forward"
        q, k, v = (torch.randn(B, h, N, D, device="cuda", dtype=dtype, requires_grad=training) for h in (Hq, Hkv, Hkv))
        if variant == "bigbird":  # block-sparse, Llama-3-8B's block grid of attnfuse bench's sparse suite
            active = bigbird_blocks(B, Hq, N)
            mask = af.BlockMask.from_blocks(active, N, N)
            kept = int(active.sum().item()) * mask.block_size**2 // (B * Hq)
            program = lambda q, k, v, **descales: bigbird_program(q, k, v, mask, **descales)  # noqa: E731
        else:
            kept, program = pairs(variant, N), PROGRAMS[variant]
        flops = (3.5 if training else 1.0) * 4 * B * Hq * kept * D

        inputs, descales, label = (q, k, v), {}, case + " fp8" * args.fp8 + " float32" * args.float32
        if args.fp8:
            inputs, _, descales = quantised(q.float(), k.float(), v.float())

        def step():
            out = program(*inputs, **descales)
            return torch.autograd.grad(out, (q, k, v), out) if training else out

        configs = (
            list(itertools.product(BACKWARD_CONFIGS["dkdv"][D], BACKWARD_CONFIGS["dq"][D])) if training else CONFIGS[D]
        )
        default_split = backward.SPLIT_PROGRAMS_PER_SM
        for per_sm in args.split_per_sm or [default_split]:
            backward.SPLIT_PROGRAMS_PER_SM = per_sm
            sweep(
                f"{label} split<{per_sm}/SM" if args.split_per_sm else label,
                args.kernel,
                configs,
                step,
                flops,
                "TFLOP/s",
                timer=kernel_time if args.gpu_time else None,
            )
        backward.SPLIT_PROGRAMS_PER_SM = default_split
    clear_cache()


if __name__ == "__main__":
    main()
