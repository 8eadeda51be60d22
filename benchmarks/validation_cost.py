"""What checking kv_lens and block_table costs a paged decode step (GPU only).

An 8-sequence decode step (Hq 32, Hkv 8, D 128, bf16, 4096-token caches, pages of 16 and 64 tokens) with
``validate=True`` (one check kernel and one host sync) and ``validate=False``: medians from
triton.testing.do_bench, and their ratio.

    python benchmarks/validation_cost.py
"""
from __future__ import annotations

import torch
from triton.testing import do_bench

import attnfuse as af


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


def decode_step(page_size: int, B: int = 8, Hq: int = 32, Hkv: int = 8, D: int = 128, tokens: int = 4096):
    """(validated, unvalidated) closures of one decode step over a shuffled paged cache."""
    pages = B * tokens // page_size
    pool_k, pool_v = (torch.randn(pages, page_size, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(pages, device="cuda").view(B, tokens // page_size).to(torch.int32)
    lens = torch.full((B,), tokens, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)

    def step(validate: bool):
        return lambda: llama(q, pool_k, pool_v, kv_lens=lens, block_table=table, validate=validate)
    return step(True), step(False)


def main() -> None:
    print(f"{'page':>5} {'validated ms':>13} {'unvalidated ms':>15} {'ratio':>6}")
    for page_size in (16, 64):
        checked, unchecked = decode_step(page_size)
        times = [do_bench(fn, warmup=25, rep=200, return_mode="median") for fn in (checked, unchecked)]
        print(f"{page_size:>5} {times[0]:>13.4f} {times[1]:>15.4f} {times[0] / times[1]:>6.2f}")


if __name__ == "__main__":
    main()
