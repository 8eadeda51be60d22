"""The template instances against the generated kernels, eager and as CUDA-graph replays (which leave the host
out): whether a gap is the kernel's or the host's. Forward and forward+backward (no graph); medians of
``triton.testing.do_bench``, bf16. ``--profile``: the host's hottest functions per call (cProfile).

    python benchmarks/template_launch.py [--N 2048,8192] [--profile] [--markdown-section docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

import attnfuse as af
from attnfuse.bench import report
from attnfuse.runtime import launch
from profile_training import host_profile  # benchmarks/, beside this script


SECTION = "template_launch"  # its marked section of docs/benchmarks.md (--markdown-section)
HEADER = "| case | engine | eager ms | graph ms | host us/call |\n|---|---|---|---|---|"
EXPLANATION = (
    "Each case twice: the template instances (ATTNFUSE_TEMPLATES=all) and the generated kernels (off). Eager: a "
    "call as a program runs it; graph: a CUDA-graph replay of it, which leaves the host out (none for a "
    "forward+backward); host us/call: the host's time per call with launches queued and not waited for. Where "
    "eager is about the host's time, the call is host-bound."
)


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


def timed(fn, graph: bool = True) -> tuple[float, float | None]:
    """(eager ms, graph-replay ms or None) of ``fn``."""
    eager = triton.testing.do_bench(fn, return_mode="median")
    if not graph:
        return eager, None
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return eager, triton.testing.do_bench(graph.replay, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", default="2048,8192", help="sequence lengths, comma-separated")
    parser.add_argument("--profile", action="store_true", help="print cProfile's hottest host functions per case")
    parser.add_argument(
        "--markdown-section", metavar="PATH", help=f"also write the table as the section '{SECTION}' of the page PATH"
    )
    options = parser.parse_args()
    lengths = [int(n) for n in options.N.split(",")]
    print(HEADER)
    table = [HEADER]
    for geometry, (B, Hq, Hkv, D) in {"gpt2": (4, 12, 12, 64), "llama3-8b": (1, 32, 8, 128)}.items():
        for N in lengths:
            q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
            dout = torch.randn_like(q)
            for program, backward in ((causal, False), (dense, False), (causal, True)):
                case = f"{geometry} N{N} {program.__name__}{' fwd+bwd' if backward else ''}"
                for mode in ("all", "off"):
                    os.environ["ATTNFUSE_TEMPLATES"] = mode
                    launch.clear_cache()
                    if backward:
                        call = lambda: program(q, k, v).backward(dout)  # noqa: E731
                    else:
                        call = lambda: program(q.detach(), k.detach(), v.detach())  # noqa: E731
                    try:
                        eager, graph = timed(call, graph=not backward)
                        host = host_us(call)
                    except Exception as exc:  # noqa: BLE001 (a row says why it has no figure)
                        table.append(f"| {case} | {mode} | {type(exc).__name__}: {exc} | |")
                        print(table[-1])
                        continue
                    engine = "template" if mode == "all" else "generated"
                    replay = "—" if graph is None else f"{graph:.3f}"
                    table.append(f"| {case} | {engine} | {eager:.3f} | {replay} | {host:.1f} |")
                    print(table[-1], flush=True)
                    if options.profile:
                        host_profile(f"{case}, {engine}", call)
    if options.markdown_section:
        name = "The template instances against the generated kernels: the host's share"
        lines = report.heading("##", name, report.script_meta(sys.argv), EXPLANATION)
        report.write_section(options.markdown_section, SECTION, "\n".join([*lines, *table]))


if __name__ == "__main__":
    main()
