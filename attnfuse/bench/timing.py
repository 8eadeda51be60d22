"""Timing: medians of ``triton.testing.do_bench``, contenders in turns, a GPU warmed up first."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def bench(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` (do_bench: 25 ms warm-up, 100 ms of repetitions)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graphed(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (no host time)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=100, return_mode="median")


def paired_bench(fns: dict[str, Callable[[], object]], rounds: int = 3) -> dict[str, float]:
    """Each function's median over ``rounds`` do_bench runs, the functions taking turns: two kernels
    compared to within a few per cent must see the same clocks."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Busy the GPU until its clocks are up, so the first row is not timed on an idle card."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
