"""What checking kv_lens and block_table costs a paged decode step (GPU only).

An 8-sequence decode step (Hq 32, Hkv 8, D 128, bf16, 4096-token caches, pages of 16 and 64 tokens) with
``validate=True`` (one check kernel, which records a bad entry on the device: no host sync) and
``validate=False``: medians from triton.testing.do_bench, and their ratio.

    python benchmarks/validation_cost.py
    python benchmarks/validation_cost.py --markdown-section docs/benchmarks.md   # rewrite its section there
"""

from __future__ import annotations

import argparse
import sys

import torch

import attnfuse as af
from attnfuse.bench import report

SECTION = "validation_cost"  # its marked section of docs/benchmarks.md (--markdown-section)
PAGE_SIZES = (16, 64)
EXPLANATION = (
    "What validate=True (the default with kv_lens) costs an eager paged decode step: 8 sequences, Hq 32, "
    "Hkv 8, D 128, bf16, 4096-token caches in shuffled pages, RoPE + causal; medians of "
    "triton.testing.do_bench, and validated over unvalidated."
)


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
        return lambda: llama(q, pool_k, pool_v, kv_lens=lens, block_table=table, kv_layout="NHD", validate=validate)

    return step(True), step(False)


def section(times: dict[int, tuple[float, float]], meta: dict[str, str]) -> str:
    """The page's section: ``times`` maps a page size to its (validated, unvalidated) ms."""
    lines = report.heading("##", "Checking a KV cache's values", meta, EXPLANATION)
    lines += ["| page size | validated ms | `validate=False` ms | ratio |", "|---|---|---|---|"]
    lines += [
        f"| {size} | {checked:.4f} | {unchecked:.4f} | {checked / unchecked:.2f} |"
        for size, (checked, unchecked) in times.items()
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--markdown-section",
        metavar="PATH",
        help=f"also write the table as the section '{SECTION}' of the page at PATH "
        f"(docs/benchmarks.md), replacing only that section",
    )
    args = parser.parse_args()
    from triton.testing import do_bench

    print(f"{'page':>5} {'validated ms':>13} {'unvalidated ms':>15} {'ratio':>6}")
    times = {}
    for page_size in PAGE_SIZES:
        checked, unchecked = decode_step(page_size)
        times[page_size] = tuple(do_bench(fn, warmup=25, rep=200, return_mode="median") for fn in (checked, unchecked))
        print(
            f"{page_size:>5} {times[page_size][0]:>13.4f} {times[page_size][1]:>15.4f} "
            f"{times[page_size][0] / times[page_size][1]:>6.2f}"
        )
    if args.markdown_section:
        report.write_section(args.markdown_section, SECTION, section(times, report.script_meta(sys.argv)))


if __name__ == "__main__":
    main()
