"""Table 9: one Llama-3-8B decoder layer (HF's LlamaDecoderLayer, random weights, B1, Hq 32, Hkv 8, D128) per
attention implementation: sdpa, flex_attention, attnfuse, attnfuse with fuse_rope.

    python benchmarks/hf_layer.py [--lengths 2048,4096,8192] [--compile-length 4096] [--no-compile] [--rounds 5]
    python benchmarks/hf_layer.py --rounds 15 --markdown-section docs/benchmarks.md   # rewrite its section there
    python benchmarks/hf_layer.py --tiny        # a CPU smoke run of the script (interpreter; no timings worth reading)
    python benchmarks/hf_layer.py --overhead-only   # just the op boundary's host time per call

For each N: the forward alone, and a training step (forward, backward, AdamW step), in ms, all in one process
on the same inputs; then one torch.compile'd training step per implementation at --compile-length. Each
implementation runs on its own copy of the layer (same weights). The implementations take turns: in each of
--rounds rounds each is timed once (triton.testing.do_bench's median), in an order rotated every round, so
none always runs on a GPU that the others have heated; a figure is the median of its rounds, "spread" the
range of its rounds over that median, and "paired" the median of each round's ratio to SDPA's figure in
that round. Runs in about 2 minutes on an H200. Also ``op_overhead()``: the host
time of a program call through the custom op against ``run_attention`` directly. benchmarks/layer_steps.py
looks inside the training steps (a profile; other ways of timing them).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Callable

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import attnfuse as af
from attnfuse import custom_op
from attnfuse.bench import report
import attnfuse.hf

LLAMA3_8B = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
BACKENDS = ("sdpa", "flex_attention", "attnfuse", "attnfuse+fuse_rope")
SECTION = "hf_layer"  # its marked section of docs/benchmarks.md (--markdown-section)


def layer_flops(config: LlamaConfig, N: int) -> float:
    """FLOPs of one forward of the layer at B1: the q/k/v/o and MLP matmuls, and causal attention (half of the
    N×N scores' two matmuls). A training step counts three forwards."""
    h, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    d = h // heads
    projections = 2 * N * h * (2 * h + 2 * kv_heads * d) + 2 * N * h * config.intermediate_size * 3
    return projections + 2 * N * N * d * heads


def bench(fn, device: torch.device) -> float:
    if device.type != "cuda":  # --tiny: run it twice, report the second
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median")


class Inputs:
    """One N's inputs, shared by every implementation: hidden states (1, N, hidden), positions (1, N), HF's
    cos and sin (1, N, D), and the causal BlockMask that flex_attention takes."""

    def __init__(
        self, config: LlamaConfig, rotary: LlamaRotaryEmbedding, N: int, device: torch.device, dtype: torch.dtype
    ):
        self.N = N
        self.x = torch.randn(1, N, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
        self.positions = torch.arange(N, device=device)[None]
        self.rope = rotary(self.x, self.positions)
        self.flex_mask = None
        if device.type == "cuda":
            from torch.nn.attention.flex_attention import create_block_mask

            self.flex_mask = create_block_mask(lambda b, h, q, k: k <= q, None, None, N, N, device=device)


class Backend:
    """One attention implementation on its own copy of the layer, with its own AdamW."""

    def __init__(self, name: str, layer: LlamaDecoderLayer):
        self.name = name
        self.layer = copy.deepcopy(layer)
        if name == "attnfuse+fuse_rope":
            attnfuse.hf.fuse_rope(self.layer)  # wraps the attention forward; also sets attnfuse
        else:  # the copy's own config
            self.layer.self_attn.config._attn_implementation = name
        self.optimizer = torch.optim.AdamW(self.layer.parameters(), lr=1e-6)

    def forward(self, inputs: Inputs) -> torch.Tensor:
        mask = inputs.flex_mask if self.name == "flex_attention" else None  # None: causal for sdpa and attnfuse
        out = self.layer(inputs.x, attention_mask=mask, position_ids=inputs.positions, position_embeddings=inputs.rope)
        return out[0] if isinstance(out, tuple) else out

    def train_step(self, inputs: Inputs, forward: Callable | None = None) -> None:
        (forward or self.forward)(inputs).float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def setup(tiny: bool) -> tuple[LlamaConfig, dict[str, Backend], Callable[[int], Inputs]]:
    """The layer's config, a Backend per implementation (flex_attention only on the GPU: it has no CPU
    backward), and the inputs for a given N: the Llama-3-8B layer in bf16 on the GPU, or a tiny one in float32
    on the CPU."""
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY if tiny else LLAMA3_8B), num_hidden_layers=1, attn_implementation="sdpa")
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device, dtype)
    rotary = LlamaRotaryEmbedding(config).to(device)
    backends = {name: Backend(name, layer) for name in BACKENDS if not (tiny and name == "flex_attention")}
    return config, backends, lambda N: Inputs(config, rotary, N, device, dtype)


def in_rounds(
    steps: dict[str, Callable[[], None]], rounds: int, device: torch.device, measure: Callable | None = None
) -> dict[str, list[float]]:
    """Each step's ms in each of ``rounds`` rounds (``bench``, or ``measure(step)``); every round times every
    step once, starting one step later than the round before."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(measure(steps[name]) if measure else bench(steps[name], device))
    return times


def median_and_spread(times: list[float]) -> tuple[float, float]:
    """The median of a figure's rounds, and their range over it."""
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median


def paired_ratio(times: list[float], baseline: list[float]) -> float:
    """The median over rounds of a figure's ms over the baseline's in the same round: each pair is timed
    seconds apart, under the same clocks and heat, which a ratio of the two medians does not ensure."""
    return statistics.median(t / b for t, b in zip(times, baseline))


def explanation(config: LlamaConfig, rounds: int) -> str:
    """What the section's tables measure."""
    h, heads = config.hidden_size, config.num_attention_heads
    return (
        f"One LlamaDecoderLayer (random weights, B1, Hq {heads}, Hkv {config.num_key_value_heads}, D {h // heads}, "
        f"hidden {h}, MLP {config.intermediate_size}) per attn_implementation, all in one process on the same "
        f"inputs: the forward alone, and a training step (forward, backward, AdamW). Each implementation runs on "
        f"its own copy of the layer, and they take turns: in each of {rounds} rounds each is timed once (the "
        f"median of triton.testing.do_bench), in an order rotated every round. A figure is the median of its "
        f'rounds; "spread" is the range of its rounds over that median. TFLOP/s count the layer\'s model FLOPs '
        f'(projections, MLP and causal attention; a training step as three forwards); "ratio" is the time over '
        f"SDPA's, \"paired\" the median of each round's own ratio to SDPA's figure in that round. Host time per "
        f"call: a warm call on a tiny causal input, so the kernel's time does not count."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--compile-length", type=int, default=4096)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--rounds", type=int, default=5, help="timings per figure, taken in turns (5)")
    parser.add_argument("--tiny", action="store_true", help="tiny layer, float32 on the CPU: checks the script runs")
    parser.add_argument("--overhead-only", action="store_true", help="only op_overhead()")
    parser.add_argument(
        "--markdown-section",
        metavar="PATH",
        help=f"also write the tables as the section '{SECTION}' of the page at PATH "
        f"(docs/benchmarks.md), replacing only that section",
    )
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.overhead_only:
        op_overhead(device, dtype)
        return
    lengths = [32, 48] if args.tiny else [int(n) for n in args.lengths.split(",")]
    compile_length = 32 if args.tiny else args.compile_length
    config, backends, inputs = setup(args.tiny)
    results: dict[tuple, list[float]] = {}
    for N in lengths:
        case = inputs(N)
        with torch.no_grad():
            times = in_rounds(
                {name: (lambda b=b: b.forward(case)) for name, b in backends.items()}, args.rounds, device
            )
        results.update({(name, N, "forward"): t for name, t in times.items()})
        times = in_rounds({name: (lambda b=b: b.train_step(case)) for name, b in backends.items()}, args.rounds, device)
        results.update({(name, N, "train"): t for name, t in times.items()})
    print(
        f"Llama-3-8B decoder layer, B1, {'tiny CPU' if args.tiny else 'bf16'}: median ms of {args.rounds} rounds, "
        f"model TFLOP/s (training step: forward + backward + AdamW, counted as 3 forwards); ratio: ms / sdpa's "
        f"ms; paired: the median of the rounds' own ratios to sdpa; spread: (slowest - fastest round) / median"
    )
    print(
        f"{'backend':<22}{'N':>6}{'fwd ms':>9}{'TFLOP/s':>9}{'ratio':>8}{'paired':>8}{'spread':>8}"
        f"{'train ms':>10}{'TFLOP/s':>9}{'ratio':>8}{'paired':>8}{'spread':>8}"
    )
    table = [
        "| backend | N | forward ms (TFLOP/s) | ratio | paired | spread | training step ms (TFLOP/s) | ratio | "
        "paired | spread |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in backends:
        for N in lengths:
            row, cells = f"{name:<22}{N:>6}", [name, str(N)]
            for step, count in (("forward", 1), ("train", 3)):
                ms, spread = median_and_spread(results[name, N, step])
                ratio = ms / median_and_spread(results["sdpa", N, step])[0]
                paired = paired_ratio(results[name, N, step], results["sdpa", N, step])
                tflops = count * layer_flops(config, N) / ms / 1e9
                row += f"{ms:>9.3f}{tflops:>9.1f}{ratio:>8.3f}{paired:>8.3f}{spread:>8.1%}"
                cells += [f"{ms:.3f} ({tflops:.1f})", f"{ratio:.3f}", f"{paired:.3f}", f"{spread:.1%}"]
            print(row)
            table.append(f"| {' | '.join(cells)} |")
    if not args.no_compile:
        table += ["", *compiled_steps(backends, inputs(compile_length), args.tiny, args.rounds, device)]
    print()
    overhead = op_overhead(device, dtype)
    if args.markdown_section:
        meta = report.script_meta(sys.argv, "float32" if args.tiny else "bf16")
        lines = report.heading(
            "##",
            "A Llama-3-8B decoder layer through HuggingFace (the paper's Table 9)",
            meta,
            explanation(config, args.rounds),
        )
        lines += [*table, "", *(f"- host time per call, {label}: {us:.1f} µs" for label, us in overhead)]
        report.write_section(args.markdown_section, SECTION, "\n".join(lines))


def compiled_steps(
    backends: dict[str, Backend], case: Inputs, tiny: bool, rounds: int, device: torch.device
) -> list[str]:
    """Each implementation's training step with its layer's forward torch.compile'd (fullgraph where it can);
    prints them, and returns their markdown table."""
    compiled, compile_s, fullgraph = {}, {}, {}
    for name, backend in backends.items():
        start = time.perf_counter()
        compiler = "aot_eager" if tiny else "inductor"
        try:  # fullgraph: a graph break raises
            compiled[name] = torch.compile(backend.forward, backend=compiler, fullgraph=True)
            backend.train_step(case, compiled[name])  # compiles
            fullgraph[name] = "yes"
        except Exception as exc:  # noqa: BLE001 - reported in the table, then compiled with breaks
            torch._dynamo.reset()
            fullgraph[name] = f"no ({type(exc).__name__})"
            compiled[name] = torch.compile(backend.forward, backend=compiler)
            backend.train_step(case, compiled[name])
        compile_s[name] = time.perf_counter() - start
    for name, forward in compiled.items():  # warm again: a reset above drops the functions compiled before it
        backends[name].train_step(case, forward)
    times = in_rounds(
        {name: (lambda b=backends[name], f=f: b.train_step(case, f)) for name, f in compiled.items()}, rounds, device
    )
    print(
        f"\ntorch.compile'd forward+backward (AdamW eager), N={case.N}: median ms of {rounds} rounds, ratio to "
        f"sdpa, paired ratio, spread, first call's compile in s, whether fullgraph=True compiled"
    )
    table = [
        f"| backend | compiled training step ms, N {case.N} | ratio | paired | spread | first call's compile, s | "
        f"fullgraph |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, t in times.items():
        ms, spread = median_and_spread(t)
        ratio, paired = ms / median_and_spread(times["sdpa"])[0], paired_ratio(t, times["sdpa"])
        print(
            f"{name:<22}{ms:>10.3f}{ratio:>8.3f}{paired:>8.3f}{spread:>8.1%}{compile_s[name]:>8.1f}  {fullgraph[name]}"
        )
        table.append(
            f"| {name} | {ms:.3f} | {ratio:.3f} | {paired:.3f} | {spread:.1%} | {compile_s[name]:.1f} | "
            f"{fullgraph[name]} |"
        )
    return table


def op_overhead(device: torch.device, dtype: torch.dtype, calls: int = 2000) -> list[tuple[str, float]]:
    """Host time per call of a warm eager program call (binding, plan lookup, launch), of the custom op that
    compiled code calls, and of ``af.run_attention`` on the traced graph, on a tiny input (so the kernel's
    time does not count): printed, and returned as (label, µs) pairs."""

    @af.attention
    def causal(q, k, v):
        return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v

    q, k, v = (torch.randn(1, 1, 16, 16, device=device, dtype=dtype) for _ in range(3))
    graph = causal.graph()
    calls = calls if device.type == "cuda" else 20

    def through_op():
        return custom_op.call(graph, q, k, v, {}, return_lse=False, kv_lens=None, block_table=None)

    measured = []
    for label, fn in (
        ("eager program call", lambda: causal(q, k, v)),
        ("the custom op", through_op),
        ("af.run_attention", lambda: af.run_attention(graph, q, k, v)),
    ):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls * 1e6
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"{label:<28}{host:8.1f} us host time per call")
        measured.append((label, host))
    return measured


if __name__ == "__main__":
    main()
