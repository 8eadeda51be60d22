"""The list suites: peak memory of a training step, and host time per call. Each returns its lines."""

from __future__ import annotations

import time

import torch

from .baselines import flex, sdpa
from .cases import GEOMETRIES, causal, rope_causal
from .host_time import breakdown_lines


def memory_lines(N: int = 16384) -> list[str]:
    """Peak GPU memory of one forward+backward, causal, Llama-3-8B geometry, against cuDNN SDPA and the
    naive reference (which materialises the scores)."""
    B, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    q, k, v = leaves
    calls = {
        "attnfuse": lambda: causal(q, k, v),
        "cuDNN SDPA": lambda: sdpa("cudnn", q, k, v, True),
        "naive reference (bf16)": lambda: causal.reference(q, k, v, dtype=torch.bfloat16),
    }
    lines = []
    for name, attend in calls.items():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        what = f"peak memory of forward+backward, causal, llama3-8b N{N}, {name}"
        try:
            out = attend()
            torch.autograd.grad(out, leaves, torch.ones_like(out))
            del out
            torch.cuda.synchronize()
            lines.append(f"{what}: {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB")
        except torch.cuda.OutOfMemoryError:
            lines.append(f"{what}: out of memory")
    return lines


def overhead_lines() -> list[str]:
    """Warm host time per call (tiny inputs, no synchronisation) and the cold first call of a new variant."""
    import attnfuse as af
    from torch.nn.attention.flex_attention import create_block_mask

    q = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)

    @af.attention
    def fresh(q, k, v):  # never compiled before in this process
        return af.softmax(af.alibi(af.sliding_window(af.rope(q, k), 64))) @ v

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fresh(q, k, v)
    torch.cuda.synchronize()
    lines = [f"cold first call of a new variant (trace + codegen + Triton compile): {time.perf_counter() - t0:.2f} s"]
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
    return lines + breakdown_lines("cuda")
