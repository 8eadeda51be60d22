"""Table 9: one Llama-3-8B decoder layer (HF's LlamaDecoderLayer, random weights, B1, Hq 32, Hkv 8, D128) per
attention implementation: sdpa, flex_attention, attnfuse, attnfuse with fuse_rope.

    python benchmarks/hf_layer.py [--lengths 2048,4096,8192] [--compile-length 4096] [--no-compile]
    python benchmarks/hf_layer.py --tiny        # a CPU smoke run of the script (interpreter; no timings worth reading)
    python benchmarks/hf_layer.py --overhead-only   # just the op boundary's host time per call
    python benchmarks/hf_layer.py --profile 8192    # the kernels and GPU idle gaps of three training steps
    python benchmarks/hf_layer.py --timing 8192     # a training step timed four ways (do_bench's figure explained)

For each N: the forward alone, and a training step (forward, backward, AdamW step), medians in ms from
triton.testing.do_bench, all in one process; then one torch.compile'd training step per implementation at
--compile-length. Runs in about 4 minutes on an H200. Also ``op_overhead()``: the host time of a program call
through the custom op against ``run_attention`` directly.
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import attnfuse as af
from attnfuse.runtime import custom_op
import attnfuse.hf

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                 rope_theta=500000.0, max_position_embeddings=8192)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
BACKENDS = ("sdpa", "flex_attention", "attnfuse", "attnfuse+fuse_rope")


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


def causal_block_mask(N: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(lambda b, h, q, k: k <= q, None, None, N, N, device=device)


class Case:
    """The layer, its inputs for one N, and the steps timed."""

    def __init__(self, layer: LlamaDecoderLayer, rotary: LlamaRotaryEmbedding, N: int, dtype: torch.dtype):
        device = next(layer.parameters()).device
        self.layer, self.N, self.device = layer, N, device
        self.x = torch.randn(1, N, layer.hidden_size, device=device, dtype=dtype, requires_grad=True)
        self.positions = torch.arange(N, device=device)[None]
        self.rope = rotary(self.x, self.positions)
        self.flex_mask = causal_block_mask(N, device)
        self.optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-6)

    def forward(self, backend: str) -> torch.Tensor:
        mask = self.flex_mask if backend == "flex_attention" else None  # None: causal for sdpa and attnfuse
        out = self.layer(self.x, attention_mask=mask, position_ids=self.positions, position_embeddings=self.rope)
        return out[0] if isinstance(out, tuple) else out

    def train_step(self, backend: str, forward=None) -> None:
        (forward or self.forward)(backend).float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def use(layer: LlamaDecoderLayer, backend: str) -> None:
    if backend == "attnfuse+fuse_rope":
        attnfuse.hf.fuse_rope(layer)  # wraps the attention forward; also sets attnfuse
    else:
        layer.self_attn.config._attn_implementation = backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--compile-length", type=int, default=4096)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny layer, float32 on the CPU: checks the script runs")
    parser.add_argument("--overhead-only", action="store_true", help="only op_overhead()")
    parser.add_argument("--timing", type=int, metavar="N", help="only time a training step per backend at N four "
                        "ways (do_bench; synchronised single steps; back-to-back steps; the SM clock after each)")
    parser.add_argument("--profile", type=int, metavar="N", help="only profile three back-to-back training steps per "
                        "backend at N: the GPU kernels that take the most time, and the GPU's idle gaps")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.overhead_only:
        return op_overhead(device, dtype)
    lengths = [32, 48] if args.tiny else [int(n) for n in args.lengths.split(",")]
    compile_length = 32 if args.tiny else args.compile_length
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY if args.tiny else LLAMA3_8B), num_hidden_layers=1, attn_implementation="sdpa")
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device, dtype)
    rotary = LlamaRotaryEmbedding(config).to(device)
    backends = [b for b in BACKENDS if not (args.tiny and b == "flex_attention")]  # no flex backward on the CPU
    if args.profile:
        return profile(layer, Case(layer, rotary, args.profile, dtype), backends)
    if args.timing:
        return timing(layer, Case(layer, rotary, args.timing, dtype), backends)
    cases = {N: Case(layer, rotary, N, dtype) for N in sorted(set(lengths) | {compile_length})}
    results: dict[tuple, float] = {}
    for backend in backends:  # fuse_rope last: its wrapper stays on the layer
        use(layer, backend)
        for N in lengths:
            case = cases[N]
            with torch.no_grad():
                results[backend, N, "forward"] = bench(lambda: case.forward(backend), device)
            results[backend, N, "train"] = bench(lambda: case.train_step(backend), device)
        if not args.no_compile:
            case = cases[compile_length]
            start = time.perf_counter()
            compiler = "aot_eager" if args.tiny else "inductor"
            try:  # fullgraph: a graph break raises
                compiled = torch.compile(case.forward, backend=compiler, fullgraph=True)
                case.train_step(backend, compiled)  # compiles
                results[backend, compile_length, "fullgraph"] = "yes"
            except Exception as exc:  # noqa: BLE001 - reported in the table, then compiled with breaks
                torch._dynamo.reset()
                results[backend, compile_length, "fullgraph"] = f"no ({type(exc).__name__})"
                compiled = torch.compile(case.forward, backend=compiler)
                case.train_step(backend, compiled)
            results[backend, compile_length, "compile_s"] = time.perf_counter() - start
            results[backend, compile_length, "train_compiled"] = bench(lambda: case.train_step(backend, compiled),
                                                                      device)
    print(f"Llama-3-8B decoder layer, B1, {'tiny CPU' if args.tiny else 'bf16'}: median ms, model TFLOP/s "
          f"(training step: forward + backward + AdamW, counted as 3 forwards); ratio: ms / sdpa's ms")
    print(f"{'backend':<22}{'N':>6}{'fwd ms':>9}{'TFLOP/s':>9}{'ratio':>8}{'train ms':>10}{'TFLOP/s':>9}{'ratio':>8}")
    for backend in backends:
        for N in lengths:
            flops = layer_flops(config, N)
            row = f"{backend:<22}{N:>6}"
            for step, count in (("forward", 1), ("train", 3)):
                ms = results[backend, N, step]
                row += f"{ms:>9.3f}{count * flops / ms / 1e9:>9.1f}{ms / results['sdpa', N, step]:>8.3f}"
            print(row)
    if not args.no_compile:
        print(f"\ntorch.compile'd forward+backward (AdamW eager), N={compile_length}: median ms, ratio to sdpa, "
              f"first call's compile in s, whether fullgraph=True compiled")
        for backend in backends:
            ms = results[backend, compile_length, "train_compiled"]
            print(f"{backend:<22}{ms:>10.3f}{ms / results['sdpa', compile_length, 'train_compiled']:>7.3f}"
                  f"{results[backend, compile_length, 'compile_s']:>8.1f}  {results[backend, compile_length, 'fullgraph']}")
    print()
    op_overhead(device, dtype)


def profile(layer: LlamaDecoderLayer, case: Case, backends: list[str], steps: int = 3) -> None:
    """The GPU kernels of ``steps`` back-to-back training steps per backend (as do_bench runs them, after
    two warm-up steps), most time first, and where the GPU waits: its idle time and the longest gaps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for backend in backends:
        use(layer, backend)
        for _ in range(2):
            case.train_step(backend)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                case.train_step(backend)
            torch.cuda.synchronize()
        print(f"=== {backend}, N={case.N}, {steps} steps")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70))
        print_gaps(prof.events())


def timing(layer: LlamaDecoderLayer, case: Case, backends: list[str], steps: int = 10) -> None:
    """A training step's ms per backend: do_bench's median; the mean of ``steps`` steps each between two
    synchronisations (CUDA events); ``steps`` back-to-back steps' total over ``steps``; each followed by the SM
    clock in MHz (NVML, where the nvidia-ml-py package is present): whether do_bench's figure is the kernels',
    the host's or a lower clock's."""
    def clock() -> str:
        try:
            return f"{torch.cuda.clock_rate()} MHz"
        except Exception:  # noqa: BLE001 - no NVML binding on this machine
            return "clock n/a"

    print(f"training step at N={case.N}: ms (SM clock after)")
    for backend in backends:
        use(layer, backend)
        for _ in range(3):
            case.train_step(backend)
        row = f"{backend:<22} do_bench {bench(lambda: case.train_step(backend), case.device):8.3f} ({clock()})"
        single = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            case.train_step(backend)
            end.record()
            torch.cuda.synchronize()
            single.append(start.elapsed_time(end))
        row += f"  single {sum(single) / steps:8.3f} ({clock()})"
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            case.train_step(backend)
        torch.cuda.synchronize()
        print(row + f"  back-to-back {(time.perf_counter() - began) * 1e3 / steps:8.3f} ({clock()})", flush=True)


def print_gaps(events, shown: int = 5) -> None:
    """The GPU's busy and idle time between its first and last kernel, and its ``shown`` longest idle gaps
    with the kernel before each and the innermost host operations running when it began."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CUDA)
    if not kernels:
        return
    host = [e for e in events if e.device_type == DeviceType.CPU]
    gaps, end, busy, before = [], kernels[0][0], 0.0, ""
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, end, before))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, name
    span = end - kernels[0][0]
    print(f"GPU busy {busy / 1e3:.3f} ms of {span / 1e3:.3f} ms from first to last kernel "
          f"(idle {(span - busy) / 1e3:.3f} ms in {len(gaps)} gaps)")
    for length, at, before in sorted(gaps, reverse=True)[:shown]:
        running = sorted((e.time_range.end - e.time_range.start, e.name) for e in host
                         if e.time_range.start <= at <= e.time_range.end)
        print(f"  {length:8.1f} us after {before[:60]}; host in: {', '.join(n for _, n in running[:3])}")


def op_overhead(device: torch.device, dtype: torch.dtype, calls: int = 2000) -> None:
    """Host time per call of a warm eager program call (binding, plan lookup, launch), of the custom op that
    compiled code calls, and of ``af.run_attention`` on the traced graph, on a tiny input (so the kernel's
    time does not count)."""
    @af.attention
    def causal(q, k, v):
        return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v

    q, k, v = (torch.randn(1, 1, 16, 16, device=device, dtype=dtype) for _ in range(3))
    graph = causal.graph()
    calls = calls if device.type == "cuda" else 20
    through_op = (lambda: custom_op.call(graph, q, k, v, {}, return_lse=False, kv_lens=None, block_table=None))
    for label, fn in (("eager program call", lambda: causal(q, k, v)), ("the custom op", through_op),
                      ("af.run_attention", lambda: af.run_attention(graph, q, k, v))):
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


if __name__ == "__main__":
    main()
