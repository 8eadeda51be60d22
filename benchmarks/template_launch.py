"""The forward template against the kernels it replaces, eager and as CUDA-graph replays (which leave the host
out): whether a gap is the kernel's or the host's. Medians of ``triton.testing.do_bench``, bf16.

    python benchmarks/template_launch.py [--N 2048,8192]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import triton

import attnfuse as af
from attnfuse.runtime import launch


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def dense(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


def host_us(fn, calls: int = 200) -> float:
    """Microseconds of host time per call of ``fn`` (launches queued, not waited for)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def timed(fn) -> tuple[float, float]:
    """(eager ms, graph-replay ms) of ``fn``."""
    eager = triton.testing.do_bench(fn, return_mode="median")
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return eager, triton.testing.do_bench(graph.replay, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", default="2048,8192", help="sequence lengths, comma-separated")
    lengths = [int(n) for n in parser.parse_args().N.split(",")]
    print("| case | engine | eager ms | graph ms | host us/call |\n|---|---|---|---|---|")
    for geometry, (B, Hq, Hkv, D) in {"gpt2": (4, 12, 12, 64), "llama3-8b": (1, 32, 8, 128)}.items():
        for N in lengths:
            q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            for program in (causal, dense):
                for mode in ("all", "off"):
                    os.environ["ATTNFUSE_TEMPLATES"] = mode
                    launch.clear_cache()
                    try:
                        eager, graph = timed(lambda: program(q, k, v))
                        host = host_us(lambda: program(q, k, v))
                    except Exception as exc:  # noqa: BLE001 (a row says why it has no figure)
                        print(f"| {geometry} N{N} {program.__name__} | {mode} | {type(exc).__name__}: {exc} | |")
                        continue
                    engine = "template" if mode == "all" else "before (hand-written or generated)"
                    case = f"{geometry} N{N} {program.__name__}"
                    print(f"| {case} | {engine} | {eager:.3f} | {graph:.3f} | {host:.1f} |", flush=True)


if __name__ == "__main__":
    main()
