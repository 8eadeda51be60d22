"""``attnfuse demo``: run examples.llama, check it against a reference, and time it against PyTorch on a GPU."""

from __future__ import annotations

import argparse
import math
import time
from typing import Callable, TextIO

from .common import CLIError

CPU_TOLERANCE = 1e-4
# bf16 check on the GPU, as attnfuse.testing.tolerances does it: twice torch's own bf16 error, plus this
# times the output's scale (not imported from there, which would need hypothesis).
BF16_ATOL = 1.6e-2


def rope_float32(x, positions, theta: float = 10000.0):
    """x (B, H, N, D) rotated at ``positions`` (N,) in float32, NeoX half split as plugins/rope.py does."""
    import torch

    from ..rotary import rotate_half

    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)
    freqs = positions.to(torch.float64)[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().float(), angles.sin().float()
    x = x.float()
    return x * cos + rotate_half(x) * sin


def _causal_flops(B: int, H: int, N: int, D: int) -> float:
    return 4.0 * B * H * D * N * (N + 1) / 2


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _sdpa(q, k, v, backend=None) -> tuple[Callable[[], object], str]:
    """A causal SDPA call with GQA, checked once: ``enable_gqa=True``, or, where the backend refuses that,
    k and v repeated to Hq heads beforehand (not inside the timed call). Returns it and a note."""
    import contextlib
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def call(q, k, v, **kw):
        with warnings.catch_warnings(), sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            warnings.simplefilter("ignore")  # SDPA warns about each backend it passes over
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)

    try:
        call(q, k, v, enable_gqa=True)
        return (lambda: call(q, k, v, enable_gqa=True)), ""
    except (RuntimeError, TypeError):
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        call(q, k, v)
        return (lambda: call(q, k, v)), " (k, v repeated)"


def _attempt(fn: Callable[[], object], out: TextIO):
    """The fused kernel's result, or None after a one-line report of why it failed (no traceback)."""
    try:
        return fn()
    except Exception as exc:
        print(f"check   FAILED: the AttnFuse kernel raised {type(exc).__name__}: {_reason(exc)}", file=out)
        return None


def _demo_cpu(out: TextIO) -> int:
    import torch

    from ..examples import llama

    B, Hq, Hkv, N, D = 1, 4, 2, 96, 32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, generator=gen) for h in (Hq, Hkv, Hkv))
    print(f"device  cpu, Triton interpreter, float32, B={B} Hq={Hq} Hkv={Hkv} N={N} D={D}", file=out)
    start = time.perf_counter()
    result = _attempt(lambda: llama(q, k, v), out)
    if result is None:
        return 1
    wall = time.perf_counter() - start
    print(f"time    {wall:.2f} s for one call (compile + interpreted run)", file=out)
    err = (result.double() - llama.reference(q, k, v)).abs().max().item()
    ok = err <= CPU_TOLERANCE
    print(
        f"check   max abs error vs llama.reference (float64): {err:.2e} (tolerance {CPU_TOLERANCE:.0e}): "
        f"{'passed' if ok else 'FAILED'}",
        file=out,
    )
    return 0 if ok else 1


def _demo_cuda(out: TextIO) -> int:
    import torch
    import triton.testing

    from ..examples import llama

    B, Hq, Hkv, N, D = 1, 32, 8, 4096, 128
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, generator=gen, device=dev, dtype=dtype) for h in (Hq, Hkv, Hkv))
    name = torch.cuda.get_device_name(dev)
    print(f"device  {name}, bfloat16, B={B} Hq={Hq} Hkv={Hkv} N={N} D={D} (Llama-3-8B geometry)", file=out)

    result = _attempt(lambda: llama(q, k, v), out)
    if result is None:
        return 1
    # Baselines: RoPE applied beforehand in float32 (Nq == Nk: the query's position is its index).
    positions = torch.arange(N, device=dev)
    q32, k32 = rope_float32(q, positions), rope_float32(k, positions)
    with torch.no_grad():
        ref = _sdpa(q32, k32, v.float())[0]()
        qr, kr = q32.to(dtype), k32.to(dtype)
        torch_err = (_sdpa(qr, kr, v)[0]().float() - ref).abs().max().item()
    err = (result.float() - ref).abs().max().item()
    bound = 2 * torch_err + BF16_ATOL * max(1.0, ref.abs().max().item())
    ok = math.isfinite(err) and err <= bound
    print(
        f"check   max abs error vs float32 SDPA: {err:.2e} (bf16 SDPA's own {torch_err:.2e}, bound {bound:.2e}): "
        f"{'passed' if ok else 'FAILED'}",
        file=out,
    )
    del ref, q32, k32

    flops = _causal_flops(B, Hq, N, D)
    print(
        "timing  median of triton.testing.do_bench; causal FLOPs 4·B·Hq·D·N(N+1)/2; baselines get q, k pre-rotated",
        file=out,
    )

    def report(label: str, fn: Callable[[], object]) -> None:
        try:
            fn()  # compile / warm up, and surface an unavailable backend before timing
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:
            print(f"  {label + ':':<30} unavailable ({_reason(exc)})", file=out)
            return
        print(f"  {label + ':':<30} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s", file=out)

    report("attnfuse (rope fused)", lambda: llama(q, k, v))

    from torch.nn.attention import SDPBackend

    for label, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            fn, note = _sdpa(qr, kr, v, backend)
        except Exception as exc:
            print(f"  {label + ':':<30} unavailable ({_reason(exc)})", file=out)
            continue
        report(label + note, fn)

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, N, N, device=dev)
        flex = torch.compile(flex_attention)
        report("flex_attention", lambda: flex(qr, kr, v, block_mask=mask, enable_gqa=True))
    except Exception as exc:
        print(f"  {'flex_attention:':<30} unavailable ({_reason(exc)})", file=out)
    return 0 if ok else 1


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    print("attnfuse demo: attnfuse.examples.llama = rope + causal + softmax, one fused kernel", file=out)
    return _demo_cuda(out) if device == "cuda" else _demo_cpu(out)


def add_parser(sub) -> None:
    """Add ``demo`` to the command's subparsers."""
    p = sub.add_parser("demo", help="run examples.llama, check it, and time it against PyTorch on a GPU")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="default: cuda when available (bf16, Llama-3-8B geometry), else cpu (interpreter)",
    )
    p.set_defaults(func=cmd_demo)
