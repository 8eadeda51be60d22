"""AttnFuse against SDPA (flash, cuDNN), compiled flex_attention and a plain hand-written FA2 Triton
forward (fa2_triton.py, dense and causal rows), in one process, on the same inputs.

    python benchmarks/bench_attention.py --suite forward [--N 4096,8192] [--out table.md]   (--help: all)

Medians from triton.testing.do_bench (AttnFuse and the hand-written kernel: the median of three runs
each, taken in turns); TFLOP/s count only the (query, key) pairs a variant keeps
(4·B·Hq·pairs·D forward; 3.5× that forward+backward). RoPE baselines pre-rotate q and k with a
torch.compile'd function, and that time is included. Each AttnFuse result is checked against a
baseline on the same inputs; the max abs difference is printed.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cold-"))  # cold compiles
os.environ.setdefault("ATTNFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="attnfuse-cold-"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

import attnfuse as af  # noqa: E402
from fa2_triton import fa2_forward  # noqa: E402

torch._dynamo.config.cache_size_limit = 1000
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 1000
flex = torch.compile(flex_attention, dynamic=False)

GEOMETRIES = {"gpt2": (4, 12, 12, 64), "llama3-8b": (1, 32, 8, 128)}
WINDOW = 256  # keys kept per query, its own included


@af.attention
def dense(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def sliding_window(q, k, v):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), WINDOW - 1)) @ v


@af.attention
def causal_alibi(q, k, v):
    return af.softmax(af.alibi(af.causal(af.scaled_dot_product(q, k)))) @ v


@af.attention
def rope_causal(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


PROGRAMS = {p.__name__: p for p in (dense, causal, sliding_window, causal_alibi, rope_causal)}


def pairs(variant: str, N: int) -> int:
    if variant == "dense":
        return N * N
    if variant == "sliding_window":
        return sum(min(i + 1, WINDOW) for i in range(N))
    return N * (N + 1) // 2


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


pre_rotate = torch.compile(lambda q, k, cos, sin: (_rotate(q, cos, sin), _rotate(k, cos, sin)))


def rope_tables(N: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
    emb = torch.arange(N, device=device, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().float(), emb.sin().float()


def alibi_slopes(H: int, device) -> torch.Tensor:
    from attnfuse_plugins.alibi import default_slopes

    return torch.tensor(default_slopes(H), device=device, dtype=torch.float32)


def flex_case(variant: str, B: int, Hq: int, N: int, device):
    """flex_attention's score_mod and BlockMask for a variant."""
    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def window_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)

    slopes = alibi_slopes(Hq, device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    mask = None
    if variant in ("causal", "causal_alibi", "rope_causal"):
        mask = create_block_mask(causal_mask, None, None, N, N, device=device)
    elif variant == "sliding_window":
        mask = create_block_mask(window_mask, None, None, N, N, device=device)
    return (alibi if variant == "causal_alibi" else None), mask


def sdpa(backend, q, k, v, causal_: bool):
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal_, enable_gqa=True)


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def paired_bench(fns: dict, rounds: int = 3) -> dict[str, float]:
    """Each function's median over ``rounds`` do_bench runs, the functions taking turns: two kernels
    compared to within a few per cent must see the same clocks."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: statistics.median(t) for name, t in times.items()}


@contextlib.contextmanager
def keys_rotated_per_tile():
    """RoPE as the fused kernel alone does it: every key tile rotated in the key loop (no key pass)."""
    from attnfuse.runtime import hoisted, launch

    saved, hoisted.HOIST_MIN_QUERY_BLOCKS = hoisted.HOIST_MIN_QUERY_BLOCKS, 10**9
    launch.clear_cache()
    try:
        yield
    finally:
        hoisted.HOIST_MIN_QUERY_BLOCKS = saved
        launch.clear_cache()


def forward_row(geometry: str, N: int, variant: str, q, k, v, cos, sin) -> dict:
    """``variant``: a PROGRAMS name, or rope_causal_per_tile (rope_causal with no key pass)."""
    if variant == "rope_causal_per_tile":
        with keys_rotated_per_tile():
            row = forward_row(geometry, N, "rope_causal", q, k, v, cos, sin)
        return {**row, "case": row["case"] + " (keys rotated per tile)"}
    B, Hq, _, D = GEOMETRIES[geometry]
    program = PROGRAMS[variant]
    rope = variant == "rope_causal"

    def inputs():
        return pre_rotate(q, k, cos, sin) if rope else (q, k)
    out = program(q, k, v)
    row = {"case": f"{geometry} N{N} {variant}", "flops": 4 * B * Hq * pairs(variant, N) * D}
    if variant in ("dense", "causal"):  # the hand-written kernel timed in turns with ours
        fn = lambda: fa2_forward(q, k, v, variant == "causal")  # noqa: E731
        row.update(paired_bench({"attnfuse": lambda: program(q, k, v), "fa2_triton": fn}))
        row["err"] = (out.float() - fn().float()).abs().max().item()
    else:
        row["attnfuse"] = bench(lambda: program(q, k, v))
    if variant in ("dense", "causal", "rope_causal"):
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                fn = lambda: sdpa(backend, *inputs(), v, variant != "dense")  # noqa: E731
                row["err"] = (out.float() - fn().float()).abs().max().item()
                row[name] = bench(fn)
            except RuntimeError as exc:
                row[name] = f"n/a ({str(exc).splitlines()[0][:40]})"
    score_mod, mask = flex_case(variant, B, Hq, N, "cuda")
    fn = lambda: flex(*inputs(), v, score_mod=score_mod, block_mask=mask, enable_gqa=True)  # noqa: E731
    row.setdefault("err", (out.float() - fn().float()).abs().max().item())
    row["flex"] = bench(fn)
    return row


def backward_row(geometry: str, N: int, variant: str, leaves, dout, cos, sin) -> dict:
    B, Hq, _, D = GEOMETRIES[geometry]
    q, k, v = leaves
    program = PROGRAMS[variant]
    rope = variant == "rope_causal"

    def train(attend):
        return lambda: torch.autograd.grad(attend(), leaves, dout)

    def inputs():
        return pre_rotate(q, k, cos, sin) if rope else (q, k)
    ours = train(lambda: program(q, k, v))
    dq = ours()[0]
    row = {"case": f"{geometry} N{N} {variant} fwd+bwd", "flops": 3.5 * 4 * B * Hq * pairs(variant, N) * D}
    if variant in ("causal", "rope_causal"):
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                fn = train(lambda: sdpa(backend, *inputs(), v, True))
                row["err"] = (dq.float() - fn()[0].float()).abs().max().item()
                row[name] = bench(fn)
            except RuntimeError as exc:
                row[name] = f"n/a ({str(exc).splitlines()[0][:40]})"
    score_mod, mask = flex_case(variant, B, Hq, N, "cuda")
    fn = train(lambda: flex(*inputs(), v, score_mod=score_mod, block_mask=mask, enable_gqa=True))
    row.setdefault("err", (dq.float() - fn()[0].float()).abs().max().item())
    row.update(paired_bench({"attnfuse": ours, "flex": fn}))  # in turns: small steps measure the host too
    return row


def run_rows(make_row, cases) -> list[dict]:
    """Rows in order; a failing row is printed and skipped, not the end of the run."""
    rows = []
    for case in cases:
        try:
            rows.append(make_row(*case))
            print(format_row(rows[-1]), flush=True)
        except Exception as exc:
            print(f"| {' '.join(map(str, case[:3]))} | failed: {type(exc).__name__}: {str(exc)[:300]} |", flush=True)
    return rows


def forward_suite(Ns: list[int], geometries: list[str], variants: list[str]) -> list[dict]:
    def cases():
        for geometry in geometries:
            B, Hq, Hkv, D = GEOMETRIES[geometry]
            for N in Ns:
                q, k, v = (torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
                cos, sin = rope_tables(N, D, "cuda")
                for variant in variants:
                    yield geometry, N, variant, q, k, v, cos, sin
    return run_rows(forward_row, cases())


def backward_suite(Ns: list[int], geometries: list[str], variants: list[str]) -> list[dict]:
    """Forward + backward (dq, dk, dv); each result's dq checked against a baseline's on the same inputs.
    AttnFuse and flex_attention take turns (three do_bench runs each): the small steps are host-bound, and
    the host's speed drifts within a run."""
    def cases():
        for geometry in geometries:
            B, Hq, Hkv, D = GEOMETRIES[geometry]
            for N in Ns:
                leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                          for h in (Hq, Hkv, Hkv)]
                dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
                cos, sin = rope_tables(N, D, "cuda")
                for variant in variants:
                    yield geometry, N, variant, leaves, dout, cos, sin
    return run_rows(backward_row, cases())


DECODE_MODELS = {"llama3-8b": (32, 8, 128, 4096), "llama3-70b": (64, 8, 128, 32768), "mistral-7b": (32, 8, 128, 16384)}


@af.attention
def decode_program(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


def decode_row(model: str, B: int, graphed: bool) -> dict:
    """One new token per sequence against a full cache; GB/s counts the K and V bytes read once.
    ``graphed``: every contender replayed from a CUDA graph (no host time); else eager calls, host
    time included wherever it exceeds the GPU's."""
    Hq, Hkv, D, N = DECODE_MODELS[model]
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = decode_program(q, k, v)
    timer = (lambda fn: do_bench_cudagraph(fn, rep=100, return_mode="median")) if graphed else bench
    row = {"case": f"decode {model} B{B} cache {N} {'CUDA graph' if graphed else 'eager'}",
           "bytes": 2 * B * Hkv * N * D * 2, "attnfuse": timer(lambda: decode_program(q, k, v))}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            fn = lambda: sdpa(backend, q, k, v, False)  # noqa: E731
            row["err"] = (out.float() - fn().float()).abs().max().item()
            row[name] = timer(fn)
        except RuntimeError as exc:
            row[name] = f"n/a ({str(exc).splitlines()[0][:40]})"
    fn = lambda: flex(q, k, v, enable_gqa=True)  # noqa: E731
    row.setdefault("err", (out.float() - fn().float()).abs().max().item())
    try:
        row["flex"] = timer(fn)
    except Exception as exc:  # compiled flex may refuse graph capture
        row["flex"] = f"n/a ({str(exc).splitlines()[0][:40]})"
    return row


def bigbird_blocks(B: int, H: int, N: int, block: int = 128, seed: int = 0, randoms: int = 3,
                   global_blocks: int = 2) -> torch.Tensor:
    """BigBird's block grid: a band of ±1 blocks, ``global_blocks`` global blocks and ``randoms`` random
    blocks per query block."""
    n = N // block
    g = torch.Generator(device="cuda").manual_seed(seed)
    active = torch.zeros(B, H, n, n, dtype=torch.bool, device="cuda")
    active.scatter_(-1, torch.randint(0, n, (B, H, n, randoms), generator=g, device="cuda"), True)
    qb, kb = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :]
    return active | ((qb - kb).abs() <= 1) | (qb < global_blocks) | (kb < global_blocks)


@af.attention
def bigbird_program(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


def flex_block_mask(active: torch.Tensor) -> BlockMask:
    """flex_attention's BlockMask for a (B, H, n, n) block grid, every active block full (no mask_mod)."""
    counts = active.sum(-1, dtype=torch.int32)
    order = torch.argsort((~active).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # active blocks first
    return BlockMask.from_kv_blocks(torch.zeros_like(counts), torch.zeros_like(order), counts, order, BLOCK_SIZE=128)


def sparse_row(N: int, train: bool) -> dict:
    """BigBird, Llama-3-8B geometry, against flex_attention with the same block grid."""
    B, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    active = bigbird_blocks(B, Hq, N)
    ours_mask = af.BlockMask.from_blocks(active, N, N, block_size=128)
    flex_mask = flex_block_mask(active)
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=train)
              for h in (Hq, Hkv, Hkv)]
    q, k, v = leaves
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)

    def run(attend):
        return (lambda: torch.autograd.grad(attend(), leaves, dout)[0]) if train else attend
    ours = run(lambda: bigbird_program(q, k, v, ours_mask))
    theirs = run(lambda: flex(q, k, v, block_mask=flex_mask, enable_gqa=True))
    pairs_kept = int(active.sum().item()) * 128 * 128 // (B * Hq)
    return {"case": f"bigbird llama3-8b N{N} ({1 - active.float().mean().item():.0%} sparse)"
                    f"{' fwd+bwd' if train else ''}",
            "flops": (3.5 if train else 1.0) * 4 * B * Hq * pairs_kept * D, "attnfuse": bench(ours),
            "flex": bench(theirs), "err": (ours().float() - theirs().float()).abs().max().item()}


def memory_suite(N: int) -> list[str]:
    """Peak GPU memory of one forward+backward, causal, Llama-3-8B geometry, against SDPA and the naive
    reference (which materialises the scores)."""
    B, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    q, k, v = leaves
    calls = {
        "attnfuse": lambda: causal(q, k, v),
        "cuDNN SDPA": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, True),
        "naive reference (bf16)": lambda: causal.reference(q, k, v, dtype=torch.bfloat16),
    }
    lines = []
    for name, attend in calls.items():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            out = attend()
            torch.autograd.grad(out, leaves, torch.ones_like(out))
            del out
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            lines.append(f"peak memory of forward+backward, causal, llama3-8b N{N}, {name}: {peak:.2f} GiB")
        except torch.cuda.OutOfMemoryError:
            lines.append(f"peak memory of forward+backward, causal, llama3-8b N{N}, {name}: out of memory")
    return lines


def overhead_suite() -> list[str]:
    """Warm host time per call (tiny inputs, no synchronisation) and the cold first call of a new variant."""
    lines = []
    q = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)

    @af.attention
    def fresh(q, k, v):  # never compiled before in this process, and the caches start empty
        return af.softmax(af.alibi(af.sliding_window(af.rope(q, k), 64))) @ v

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fresh(q, k, v)
    torch.cuda.synchronize()
    lines.append(f"cold first call of a new variant (trace + codegen + Triton compile): "
                 f"{time.perf_counter() - t0:.2f} s")
    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 128, 128, device="cuda")
    calls = {
        "attnfuse causal": lambda: causal(q, k, v),
        "attnfuse rope+causal": lambda: rope_causal(q, k, v),
        "SDPA causal": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        "flex causal": lambda: flex(q, k, v, block_mask=mask),
    }
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 500
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        lines.append(f"warm host time per call, {name}: {host * 1e6:.1f} us")
    return lines


def cell(row: dict, key: str) -> str:
    """ms, with TFLOP/s (compute-bound rows) or GB/s (decode rows, by bytes read) beside it."""
    value = row.get(key)
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    if "bytes" in row:
        return f"{value:.3f} ({row['bytes'] / value / 1e6:.0f} GB/s)"
    return f"{value:.3f} ({row['flops'] / value / 1e9:.0f})"


def format_row(row: dict) -> str:
    speedup = row["flex"] / row["attnfuse"] if isinstance(row.get("flex"), float) else float("nan")
    return (f"| {row['case']} | {cell(row, 'attnfuse')} | {cell(row, 'fa2_triton')} | {cell(row, 'cudnn')} | "
            f"{cell(row, 'flash')} | {cell(row, 'flex')} | {speedup:.2f}× | {row.get('err', float('nan')):.1e} |")


HEADER = ("| case | AttnFuse ms (TFLOP/s) | FA2 Triton (hand-written) | cuDNN SDPA | FA2 SDPA | flex (compiled) | "
          "flex / AttnFuse | max abs diff |\n|---|---|---|---|---|---|---|---|")


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Busy the GPU until its clocks are up, so the first row is not timed on an idle card."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="forward,backward,decode,sparse,memory,overhead")
    parser.add_argument("--N", default="2048,4096,8192,16384")
    parser.add_argument("--geometries", default="gpt2,llama3-8b")
    parser.add_argument("--variants", default=",".join([*PROGRAMS, "rope_causal_per_tile"]))
    parser.add_argument("--backward-N", default="2048,4096,8192")
    parser.add_argument("--backward-variants", default="causal,rope_causal,sliding_window")
    parser.add_argument("--out", help="also write the table (markdown) here")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    title = (f"{datetime.date.today()} · {props.name} · torch {torch.__version__} · "
             f"triton {__import__('triton').__version__} · bf16, median ms (TFLOP/s)")
    print(title)
    warm_up_gpu()
    lines = [title, ""]
    Ns, backward_Ns = [int(n) for n in args.N.split(",")], [int(n) for n in args.backward_N.split(",")]
    geometries = args.geometries.split(",")
    tables = {  # suite -> (title, rows)
        "forward": ("Forward", lambda: forward_suite(Ns, geometries, args.variants.split(","))),
        "backward": ("Forward + backward",
                     lambda: backward_suite(backward_Ns, geometries, args.backward_variants.split(","))),
        "decode": ("Decoding (one query per sequence, full cache)",
                   lambda: run_rows(decode_row, [(model, B, graphed) for graphed in (False, True)
                                                 for model in DECODE_MODELS for B in (1, 8)])),
        "sparse": ("Block-sparse (BigBird)",
                   lambda: run_rows(sparse_row, [(N, train) for train in (False, True) for N in (4096, 16384)])),
    }
    lists = {"memory": ("Memory", lambda: memory_suite(16384)), "overhead": ("Host overhead", overhead_suite)}
    for suite in args.suite.split(","):
        if suite in tables:
            print(HEADER)
            name, rows = tables[suite]
            lines += [f"## {name}", "", HEADER, *map(format_row, rows()), ""]
        else:
            name, items = lists[suite]
            found = items()
            print("\n".join(found), flush=True)
            lines += [f"## {name}", "", *[f"- {line}" for line in found], ""]
        save(args.out, lines)


def save(path: str | None, lines: list[str]) -> None:
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
