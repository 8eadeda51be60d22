"""Context parallelism on GPUs: AttnFuse's ring (``attnfuse.distributed``) against torch's context-parallel SDPA
(``torch.distributed.tensor.experimental.context_parallel`` around cuDNN attention), forward+backward.

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py [--lengths 65536 131072 262144]
        [--programs causal rope_causal] [--rounds 5] [--check 32768] [--json cp2.json]
    torchrun --nproc-per-node 1 benchmarks/context_parallel.py ...   # 1 GPU: the plain program and plain SDPA

Llama-3-8B geometry (B1, Hq 32, Hkv 8, D128, bfloat16; SDPA gets K/V expanded to 32 heads). For each program
and N, on the same GPUs and inputs: the median over ``--rounds`` of one forward+backward step timed with
CUDA events (every rank runs the same steps: collectives forbid do_bench's adaptive repeats), the slowest
rank's; the peak memory per GPU of a step; and, on 2 or more GPUs, the ring's overhead: the step with a ring
that moves nothing (``attnfuse.distributed.ring.LocalRing``: the same kernels, no communication) subtracted,
per ring step (W forward and W backward steps). ``--check N`` first compares the ring's out and gradients with
the program on one GPU (every rank runs it on the whole sequence) and both with a float32 SDPA reference.
RoPE+causal in SDPA rotates q and k with a compiled function first (cos/sin sharded with them).

    python benchmarks/context_parallel.py --model      # no GPU: the scaling model of docs/context-parallel.md

``--model`` prints when the ring's communication per step (a K/V shard over NVLink or InfiniBand, datasheet
bandwidths) stays below the kernel time per step (from the measured Llama-3-8B causal rows of
docs/benchmarks.md), and the smallest shard length at which it does, for 8 and 64 GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import attnfuse as af
import attnfuse.distributed as afd
from attnfuse.distributed.ring import LocalRing
from attnfuse.rotary import rotate_half

THETA = 500000.0  # Llama-3's rope_theta


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def rope_causal(q, k, v):
    return af.softmax(af.causal(af.rope(q, k, theta=THETA))) @ v


PROGRAMS = {"causal": causal, "rope_causal": rope_causal}


# The scaling model's inputs. Measured: docs/benchmarks.md (H200), Llama-3-8B causal,
# AttnFuse's generated kernels (the ring's: the Hopper templates take no positions), ms by shard length.
MEASURED_FORWARD_MS = {2048: 0.111, 8192: 1.127, 16384: 4.219}
MEASURED_STEP_MS = {2048: 0.680, 8192: 5.020}  # forward+backward
# Datasheet assumptions, bytes per second each way per GPU (the ring sends one shard and receives one per step)
LINKS = {
    "NVLink 4 (H200 SXM datasheet: 900 GB/s per GPU, both ways together)": 450e9,
    "InfiniBand NDR (ConnectX-7 datasheet: 400 Gb/s per GPU each way)": 50e9,
}


def scaling_model(heads: tuple[int, int] = (32, 8), head_dim: int = 128) -> str:
    """The model's tables (markdown): per ring step, a rank's kernels run the (query, key) pairs of a causal
    call of its shard's length n (zigzag: half of an n x n block), so their time is the measured causal
    time at N = n; the forward moves the K/V shard (bfloat16), the backward K/V and dK/dV (float32)."""
    _, hkv = heads
    fwd_bytes = 2 * hkv * head_dim * 2  # per token of a shard: K and V, bfloat16
    bwd_bytes = fwd_bytes + 2 * hkv * head_dim * 4  # and dK, dV in float32
    lines = [
        "| shard n | link | forward: kernels / communication ms | backward: kernels / communication ms |",
        "|---|---|---|---|",
    ]
    for n, step in MEASURED_STEP_MS.items():
        fwd = MEASURED_FORWARD_MS[n]
        for link, bandwidth in LINKS.items():
            lines.append(
                f"| {n} | {link.split(' (')[0]} | {fwd:.3f} / {fwd_bytes * n / bandwidth * 1e3:.3f} | "
                f"{step - fwd:.3f} / {bwd_bytes * n / bandwidth * 1e3:.3f} |"
            )
    # kernel time a * n^2 (a from each measured point), communication b * n: hidden from n* = b / a
    lines += ["", "| link | smallest shard n hiding the forward's communication | the backward's |", "|---|---|---|"]
    hidden = {}
    for link, bandwidth in LINKS.items():
        fwd = [fwd_bytes / bandwidth / (MEASURED_FORWARD_MS[n] * 1e-3 / n**2) for n in MEASURED_STEP_MS]
        bwd = [
            bwd_bytes / bandwidth / ((MEASURED_STEP_MS[n] - MEASURED_FORWARD_MS[n]) * 1e-3 / n**2)
            for n in MEASURED_STEP_MS
        ]
        hidden[link] = max(*fwd, *bwd)
        lines.append(
            f"| {link.split(' (')[0]} | {' to '.join(f'{x:.0f}' for x in fwd)} | "
            f"{' to '.join(f'{x:.0f}' for x in bwd)} |"
        )
    lines += ["", "| GPUs | N | shard n | NVLink hides it | InfiniBand hides it |", "|---|---|---|---|---|"]
    for world in (8, 64):
        for N in (262144, 1048576):
            n = N // world
            flags = ["yes" if n >= hidden[link] else "no" for link in LINKS]
            lines.append(f"| {world} | {N} | {n} | {flags[0]} | {flags[1]} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536, 131072, 262144])
    parser.add_argument("--programs", nargs="+", choices=list(PROGRAMS), default=list(PROGRAMS))
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per figure (their median)")
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--check", type=int, default=32768, help="N of the correctness check (0: none)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's context-parallel SDPA")
    parser.add_argument("--json", default="", help="write the rows here (rank 0)")
    parser.add_argument("--model", action="store_true", help="print the scaling model (no GPU) and exit")
    args = parser.parse_args(argv)
    args.heads = tuple(args.heads)
    return args


def timed(step: Callable[[], None], rounds: int) -> float:
    """The median ms of ``rounds`` steps (after one warm-up), the slowest rank's."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return slowest(statistics.median(times))


def peak_gib(step: Callable[[], None]) -> float:
    """The peak memory allocated during one step, GiB, the largest rank's."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return slowest(torch.cuda.max_memory_allocated() / 2**30)


def slowest(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def inputs(N: int, args: argparse.Namespace, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, dout of the whole sequence (the same on every rank), bfloat16."""
    Hq, Hkv = args.heads
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [
        (1, Hq, N, args.head_dim),
        (1, Hkv, N, args.head_dim),
        (1, Hkv, N, args.head_dim),
        (1, Hq, N, args.head_dim),
    ]
    return [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes]


def rope_tables(N: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos, sin (N, D) for positions 0 .. N-1."""
    inv = THETA ** (-torch.arange(0, D, 2, dtype=torch.float64, device="cuda") / D)
    angles = torch.arange(N, dtype=torch.float64, device="cuda")[:, None] * inv
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@torch.compile
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def attnfuse_step(program, world: int, q, k, v, dout, local: bool = False) -> Callable[[], None]:
    """One forward+backward of ``program``: the ring over the group's shards, or on one GPU the program."""
    if world == 1:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        run = program
    else:
        leaves = [afd.shard(t).requires_grad_(True) for t in (q, k, v)]
        dout = afd.shard(dout)
        run = afd.context_parallel(program)
        if local:
            run.ring = LocalRing(run.ring.rank, run.ring.world)

    def step():
        for t in leaves:
            t.grad = None
        run(*leaves).backward(dout)

    return step


def torch_step(name: str, world: int, q, k, v, dout, stack) -> Callable[[], None]:
    """One forward+backward of cuDNN SDPA, K/V expanded to Hq heads, inside torch's context_parallel on 2 or
    more GPUs (entered once, on ``stack``: it shards its buffers in place)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().clone() for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    dout = dout.clone()
    cos, sin = rope_tables(q.shape[2], q.shape[3], q.dtype)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cuda", (world,))
        stack.enter_context(
            context_parallel(mesh, buffers=[q, k, v, dout, cos, sin], buffer_seq_dims=[2, 2, 2, 2, 0, 0])
        )
    leaves = [t.requires_grad_(True) for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        qq, kk, vv = leaves
        if name == "rope_causal":
            qq, kk = rotate(qq, cos, sin), rotate(kk, cos, sin)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).backward(dout)

    return step


def check(program, name: str, N: int, args: argparse.Namespace, world: int, rank: int) -> None:
    """The ring against the program on one GPU, and both against float32 SDPA, at N (bfloat16)."""
    q, k, v, dout = inputs(N, args, seed=1)
    shards = [afd.shard(t).requires_grad_(True) for t in (q, k, v)]
    out = afd.context_parallel(program)(*shards)
    out.backward(afd.shard(dout))
    ring = [afd.unshard(t) for t in (out.detach(), *(s.grad for s in shards))]
    whole = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = program(*whole)
    one = [out, *torch.autograd.grad(out, whole, dout)]
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    qq, kk, vv = leaves[0], leaves[1].repeat_interleave(group, 1), leaves[2].repeat_interleave(group, 1)
    if name == "rope_causal":
        cos, sin = rope_tables(N, q.shape[3], torch.float32)
        qq, kk = rotate(qq, cos, sin), rotate(kk, cos, sin)
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    reference = [out, *torch.autograd.grad(out, leaves, dout.float())]
    if rank == 0:
        for what, a, b, r in zip(("out", "dq", "dk", "dv"), ring, one, reference):
            print(
                f"check {name} N={N} W={world} {what}: max |ring - 1 GPU| {_diff(a, b):.3g}; max error vs "
                f"float32 SDPA: ring {_diff(a, r):.3g}, 1 GPU {_diff(b, r):.3g} (max |reference| "
                f"{r.abs().max().item():.3g})",
                flush=True,
            )


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main() -> None:
    import contextlib

    args = parse_args()
    if args.model:
        print(scaling_model(args.heads, args.head_dim))
        return
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    if rank == 0:
        print(
            f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, geometry B1 Hq{args.heads[0]} "
            f"Hkv{args.heads[1]} D{args.head_dim} bfloat16; ms are medians of {args.rounds} steps",
            flush=True,
        )
    for name in args.programs:
        program = PROGRAMS[name]
        if args.check and world > 1:
            check(program, name, args.check, args, world, rank)
        for N in args.lengths:
            q, k, v, dout = inputs(N, args)
            row = {"program": name, "N": N, "gpus": world}
            step = attnfuse_step(program, world, q, k, v, dout)
            row["attnfuse_ms"] = timed(step, args.rounds)
            row["attnfuse_peak_gib"] = peak_gib(step)
            if world > 1:
                local = timed(attnfuse_step(program, world, q, k, v, dout, local=True), args.rounds)
                row["kernels_ms"] = local
                row["overhead_per_step_ms"] = (row["attnfuse_ms"] - local) / (2 * world)
                row["overhead_share"] = (row["attnfuse_ms"] - local) / local
            if not args.no_torch:
                with contextlib.ExitStack() as stack:
                    try:
                        step = torch_step(name, world, q, k, v, dout, stack)
                        row["torch_ms"] = timed(step, args.rounds)
                        row["torch_peak_gib"] = peak_gib(step)
                    except Exception as exc:  # an API another torch lacks: say so, keep AttnFuse's figures
                        row["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
            flops = 3.5 * 2 * N * N * args.heads[0] * args.head_dim  # causal: half of 2 products; backward 2.5x
            row["attnfuse_tflops_per_gpu"] = flops / (row["attnfuse_ms"] * 1e-3) / world / 1e12
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            del q, k, v, dout
            torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
