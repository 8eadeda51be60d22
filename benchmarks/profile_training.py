"""Where the time of one causal forward+backward goes: each CUDA kernel's time (torch.profiler), and the
host time per call, AttnFuse against flex_attention (and SDPA's host time).

    python benchmarks/profile_training.py [--cases llama3-8b:2048,llama3-8b:4096,gpt2:2048]

When the host time per call exceeds the kernels' sum, a call is host-bound and do_bench's figure for it
measures the host as much as the kernels.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bench_attention as b


def kernel_times(name: str, step, calls: int = 10) -> None:
    """Print each CUDA kernel's mean time per call of ``step``."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows = sorted(((e.self_device_time_total / calls, e.key) for e in prof.key_averages()
                   if e.self_device_time_total > 0), reverse=True)
    print(f"--- {name}: kernels {sum(t for t, _ in rows):.0f} us per call")
    for t, key in rows[:8]:
        print(f"   {t:8.1f} us  {key[:70]}")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="llama3-8b:2048,llama3-8b:4096,gpt2:2048")
    args = parser.parse_args()
    for case in args.cases.split(","):
        geometry, N = case.split(":")
        B, Hq, Hkv, D = b.GEOMETRIES[geometry]
        leaves = [torch.randn(B, h, int(N), D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for h in (Hq, Hkv, Hkv)]
        dout = torch.randn(B, Hq, int(N), D, device="cuda", dtype=torch.bfloat16)
        _, mask = b.flex_case("causal", B, Hq, int(N), "cuda")
        steps = {
            "attnfuse": lambda: torch.autograd.grad(b.causal(*leaves), leaves, dout),
            "flex": lambda: torch.autograd.grad(b.flex(*leaves, block_mask=mask, enable_gqa=True), leaves, dout),
            "sdpa (cuDNN)": lambda: torch.autograd.grad(b.sdpa(b.SDPBackend.CUDNN_ATTENTION, *leaves, True), leaves,
                                                        dout),
        }
        for name, step in steps.items():
            if name != "sdpa (cuDNN)":
                kernel_times(f"{case} {name}", step)
            host_time(f"{case} {name} fwd+bwd", step)


if __name__ == "__main__":
    main()
