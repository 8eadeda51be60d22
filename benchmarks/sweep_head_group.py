"""How many heads the generated forward and dQ kernels should run together (HEAD_GROUP,
``launcher.head_group``): their time with one head at a time, with groups of whole GQA groups whose keys
and values fill a share of the L2 cache (``--shares``), with all heads together, and as the launcher
chooses, bf16, in rounds taken in turns (median ms of do_bench per round, then the median of the rounds).

    python benchmarks/sweep_head_group.py [--shares 0.25 0.5 1] [--rounds 3]

Llama-3-8B's causal programs at D 128 run the Hopper templates, so its rows here are the generated-kernel
variants (ALiBi, sliding window).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from attnfuse.bench.cases import GEOMETRIES, PROGRAMS
from attnfuse.runtime import inputs, launcher

CASES = [
    ("gpt2", "causal", 2048),
    ("gpt2", "causal_alibi", 2048),
    ("gpt2", "causal", 8192),
    ("gpt2", "causal_alibi", 8192),
    ("gpt2", "sliding_window", 8192),
    ("llama3-8b", "causal_alibi", 2048),
    ("llama3-8b", "causal_alibi", 8192),
    ("llama3-8b", "sliding_window", 8192),
]
BACKWARD = [("gpt2", "causal", 2048), ("gpt2", "causal", 8192), ("llama3-8b", "causal_alibi", 8192)]


def choices(shares: list[float], geometry: str) -> dict[str, object]:
    """Each setting's HEAD_GROUP, as ``head_group(heads, kv_bytes, device)`` for ``geometry``'s GQA group."""
    B, Hq, Hkv, _ = GEOMETRIES[geometry]
    group = Hq // Hkv
    out = {"one head": lambda heads, kv_bytes, device: 1}
    for share in shares:  # whole GQA groups whose keys and values fill at most ``share`` of the L2 cache
        out[f"share {share}"] = lambda heads, kv_bytes, device, share=share: min(
            heads, group * max(1, int(share * launcher.l2_bytes(device) // (kv_bytes // (B * Hkv))))
        )
    out["all heads"] = lambda heads, kv_bytes, device: heads
    out["launcher's"] = launcher.head_group
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", type=float, nargs="*", default=[0.25, 0.5, 1.0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"L2 cache: {launcher.l2_bytes(torch.device('cuda')) / 2**20:.1f} MiB; launcher's L2_SHARE {launcher.L2_SHARE}"
    )
    steps = {}
    for (geometry, variant, N), backward in [(c, False) for c in CASES] + [(c, True) for c in BACKWARD]:
        B, Hq, Hkv, D = GEOMETRIES[geometry]
        leaves = [
            torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for h in (Hq, Hkv, Hkv)
        ]
        program = PROGRAMS[variant]
        if backward:
            dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)

            def step(p=program, x=leaves, g=dout):
                return torch.autograd.grad(p(*x), x, g)
        else:

            def step(p=program, x=leaves):
                return p(*x)

        kv_mb = B * Hkv * N * D * 2 * 2 / 1e6
        steps[f"{geometry} {variant} N{N}{' fwd+bwd' if backward else ''} (K, V {kv_mb:.1f} MB)"] = (geometry, step)
    chooser = {geometry: choices(args.shares, geometry) for geometry in GEOMETRIES}
    names = list(chooser["gpt2"])
    times = {(case, name): [] for case in steps for name in names}
    for r in range(args.rounds):
        for name in names:
            for case, (geometry, step) in steps.items():
                inputs.head_group = chooser[geometry][name]
                times[(case, name)].append(triton.testing.do_bench(step))
        print(f"round {r + 1} done", flush=True)
    inputs.head_group = launcher.head_group
    print("case | " + " | ".join(names))
    for case in steps:
        print(case + " | " + " | ".join(f"{statistics.median(times[(case, n)]):.4f}" for n in names), flush=True)


if __name__ == "__main__":
    main()
