"""Where a warm eager call's host time goes: the whole ``program(...)`` call and each of its pieces, timed
alone over the same inputs (no synchronisation), in microseconds per call."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

import attnfuse as af
from attnfuse.runtime import launch
from attnfuse.runtime.validate import check_call_values

from .cases import bigbird_program, causal, decode_program, rope_tables

PIECES = ("whole call", "arguments and trace lookup", "call signature lookup", "kv_lens/block_table check", "launches")


def per_call_us(fn: Callable[[], Any], calls: int, warmup: int = 5) -> float:
    """Host microseconds per call of ``fn``, over ``calls`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def breakdown(
    program: af.AttentionProgram, q, k, v, *extra: Any, calls: int = 500, kv_lens=None, block_table=None
) -> dict[str, float]:
    """Microseconds per warm call of ``program(q, k, v, *extra, kv_lens=..., block_table=...)`` and of each
    piece of it (``PIECES``; the check only with ``kv_lens``): the pieces are timed alone, so their sum
    differs from the whole by the timer's and the glue's share."""
    (q, k, v), args, kwargs = program._take_qkv((q, k, v, *extra), {})
    statics, inputs = program._bind(args, kwargs)
    graph = program._trace(statics)
    grads = launch.wanted_grads(q, k, v, inputs)

    def signature():
        return launch.planned(
            graph, q, k, v, inputs, kv_lens, block_table, return_lse=False, grads=grads, split_kv=None
        )

    def trace_lookup():
        (_, args, kwargs) = program._take_qkv((q, k, v, *extra), {})
        return program._trace(program._bind(args, kwargs)[0])

    call = signature()
    pieces = {
        "whole call": lambda: program(q, k, v, *extra, kv_lens=kv_lens, block_table=block_table),
        "arguments and trace lookup": trace_lookup,
        "call signature lookup": signature,
        "launches": lambda: call(q, k, v, inputs, kv_lens, block_table),
    }
    if kv_lens is not None:
        pieces["kv_lens/block_table check"] = lambda: check_call_values(k, kv_lens, block_table)
    return {name: per_call_us(pieces[name], calls) for name in PIECES if name in pieces}


def breakdown_line(case: str, times: dict[str, float]) -> str:
    """One line: the whole call, then each piece."""
    whole = times["whole call"]
    parts = ", ".join(f"{name} {us:.1f}" for name, us in times.items() if name != "whole call")
    return f"host time per warm call, {case}: {whole:.1f} us ({parts})"


@af.attention
def rope_tables_causal(q, k, v, cos, sin):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


def breakdown_lines(device: str, calls: int = 500, N: int = 128, D: int = 64) -> list[str]:
    """The breakdown of tiny calls (B1, 4 heads, ``N`` rows, head dim ``D``) of four kinds of call: causal,
    rope+causal with cos/sin tables, a BlockMask program, and a decoding step (one query) on a paged cache
    with kv_lens and block_table, validated."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 4, N, D, device=device, dtype=dtype) for _ in range(3))
    cos, sin = rope_tables(N, D, device)
    mask = af.create_block_mask_from_blocks(
        lambda b, h, qb, kb: kb <= qb, None, None, N, N, block_size=min(N, 64), device=device
    )
    page, pages = 16, -(-N // 16)
    pool_k, pool_v = (torch.randn(pages, page, 4, D, device=device, dtype=dtype) for _ in range(2))
    table = torch.arange(pages, device=device, dtype=torch.int32)[None]
    lens = torch.tensor([N], device=device, dtype=torch.int32)
    cases = {
        "causal": (causal, (q, k, v), {}),
        "rope+causal, cos/sin tables": (rope_tables_causal, (q, k, v, cos, sin), {}),
        "BlockMask (causal blocks)": (bigbird_program, (q, k, v, mask), {}),
        "decode, paged, kv_lens and block_table, validated": (
            decode_program,
            (q[:, :, -1:], pool_k, pool_v),
            {"kv_lens": lens, "block_table": table},
        ),
    }
    return [
        breakdown_line(case, breakdown(program, *args, calls=calls, **options))
        for case, (program, args, options) in cases.items()
    ]
