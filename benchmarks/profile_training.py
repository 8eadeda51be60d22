"""Where the time of one forward+backward (causal, sliding window, RoPE+causal or BigBird) goes: each CUDA kernel's time
(torch.profiler) and the host time per call, AttnFuse against flex_attention and cuDNN SDPA, and
optionally the Python functions that take AttnFuse's host time (cProfile).

    python benchmarks/profile_training.py [--cases llama3-8b:2048,gpt2:2048] [--variant rope_causal] [--host-profile]
        [--ops] [--dropout 0.1]

When the host time per call exceeds the kernels' sum, a call is host-bound and do_bench's figure for it
measures the host as much as the kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import attnfuse as af
from attnfuse.bench.baselines import flex, flex_block_mask, flex_case, pre_rotate, sdpa, sdpa_dropout
from attnfuse.bench.cases import GEOMETRIES, PROGRAMS, bigbird_blocks, bigbird_program, rope_tables


def _profiled(step, calls: int, activities: list) -> profile:
    """torch.profiler's record of ``calls`` calls of ``step``, after three warm-up calls."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return prof


def kernel_means(step, calls: int = 10) -> list[tuple[float, str]]:
    """(mean µs per call of ``step``, name) of each CUDA kernel it runs, longest first (torch.profiler)."""
    prof = _profiled(step, calls, [ProfilerActivity.CUDA])
    return sorted(
        ((e.self_device_time_total / calls, e.key) for e in prof.key_averages() if e.self_device_time_total > 0),
        reverse=True,
    )


def kernel_times(name: str, step, calls: int = 10) -> None:
    """Print each CUDA kernel's mean time per call of ``step``."""
    rows = kernel_means(step, calls)
    print(f"--- {name}: kernels {sum(t for t, _ in rows):.0f} us per call")
    for t, key in rows[:8]:
        print(f"   {t:8.1f} us  {key[:70]}")


def op_times(name: str, step, calls: int = 10) -> None:
    """Print the PyTorch ops (aten::…) whose kernels take GPU time in ``step``: the copies, fills, sums
    and conversions around the attention kernels."""
    prof = _profiled(step, calls, [ProfilerActivity.CPU, ProfilerActivity.CUDA])
    print(f"--- {name}: PyTorch ops with GPU time")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.key.startswith("aten::") and e.device_time_total > 0:
            print(f"   {e.device_time_total / calls:8.1f} us  {e.key}")


def host_time(name: str, step, calls: int = 50) -> None:
    """Print the host time per call of ``step`` (no synchronisation inside the loop) and the wall time."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / calls
    print(f"{name}: host {host * 1e6:.0f} us per call, wall {wall * 1e6:.0f} us", flush=True)


def host_profile(name: str, step, calls: int = 200, top: int = 25) -> None:
    """Print the Python functions that take the host time of ``step`` (cProfile, by own time)."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    print(f"--- {name}: host functions, own time per call (cProfile adds its own overhead)")
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    for (path, line, func), (_, ncalls, own, cumulative, _) in rows:
        where = f"{path.rsplit('/', 2)[-2:][-1]}:{line}({func})"
        print(
            f"   {own / calls * 1e6:8.1f} us own {cumulative / calls * 1e6:8.1f} us cum "
            f"{ncalls / calls:5.1f}x  {where[:90]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="llama3-8b:2048,llama3-8b:4096,gpt2:2048")
    parser.add_argument(
        "--variant",
        default="causal",
        help="causal, sliding_window, rope_causal (flex on pre-rotated q, k) or bigbird (block-sparse)",
    )
    parser.add_argument(
        "--dropout", type=float, default=0.0, help="attention dropout p (causal only; flex has none, so no flex row)"
    )
    parser.add_argument("--host-profile", action="store_true", help="also print cProfile's host functions")
    parser.add_argument("--ops", action="store_true", help="also print AttnFuse's PyTorch ops with GPU time")
    args = parser.parse_args()
    if args.dropout and args.variant != "causal":
        parser.error("--dropout: the causal variant only (cuDNN's SDPA with dropout is the baseline)")
    for case in args.cases.split(","):
        geometry, N = case.split(":")
        B, Hq, Hkv, D = GEOMETRIES[geometry]
        leaves = [
            torch.randn(B, h, int(N), D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for h in (Hq, Hkv, Hkv)
        ]
        dout = torch.randn(B, Hq, int(N), D, device="cuda", dtype=torch.bfloat16)
        q, k, v = leaves
        cos, sin = rope_tables(int(N), D, "cuda")

        def inputs():
            return pre_rotate(q, k, cos, sin) if args.variant == "rope_causal" else (q, k)

        if args.variant == "bigbird":  # block-sparse: the same block grid for both, no SDPA equivalent
            active = bigbird_blocks(B, Hq, int(N))
            ours_mask, mask = af.BlockMask.from_blocks(active, int(N), int(N)), flex_block_mask(active)
            ours = lambda: bigbird_program(*leaves, ours_mask)  # noqa: E731
        else:
            _, mask = flex_case(args.variant, Hq, int(N), "cuda")
            ours = lambda: PROGRAMS[args.variant](*leaves, dropout_p=args.dropout)  # noqa: E731
        steps = {"attnfuse": lambda: torch.autograd.grad(ours(), leaves, dout)}
        if args.dropout:  # flex_attention has no dropout
            cudnn = lambda: sdpa_dropout("cudnn", q, k, v, args.dropout)  # noqa: E731
            steps["sdpa (cuDNN)"] = lambda: torch.autograd.grad(cudnn(), leaves, dout)
        else:
            theirs = lambda: flex(*inputs(), v, block_mask=mask, enable_gqa=True)  # noqa: E731
            steps["flex"] = lambda: torch.autograd.grad(theirs(), leaves, dout)
            if args.variant != "bigbird":
                steps["sdpa (cuDNN)"] = lambda: torch.autograd.grad(sdpa("cudnn", *inputs(), v, True), leaves, dout)
        for name, step in steps.items():
            label = f"{case} {args.variant} {name}"
            host_time(f"{label} fwd+bwd", step)  # first: a profiler may leave launch hooks behind
            if args.host_profile and name == "attnfuse":
                host_profile(label, step)
            if args.ops and name == "attnfuse":
                op_times(label, step)
            kernel_times(label, step)


if __name__ == "__main__":
    main()
