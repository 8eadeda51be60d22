"""The ``attnfuse`` command: list the registered combinators, show a program's generated kernel, run a demo.

    attnfuse list
    attnfuse show llama --arch interpreter --dtype float32 --head-dim 32
    attnfuse show mypackage.models:my_attention --source-only > kernel.py
    attnfuse demo
    attnfuse bench --suite forward --json out.json --plot out.png     (a CUDA GPU; attnfuse/bench/)
    attnfuse new prefix_lm --role mask
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import re
import sys
import time
from typing import Callable, Sequence, TextIO

PROG = "attnfuse"
CPU_TOLERANCE = 1e-4
# bf16 check on the GPU, as attnfuse.testing.tolerances does it: twice torch's own bf16 error, plus this
# times the output's scale (not imported from there, which would need hypothesis).
BF16_ATOL = 1.6e-2


class CLIError(Exception):
    """A usage error: printed as ``attnfuse: error: ...``, exit code 2."""


# --------------------------------------------------------------------------------------------------- list

def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]
    lines = []
    for row in (header, *rows):
        cells = [c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _first_line(doc: str) -> str:
    for line in (doc or "").strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def cmd_list(args: argparse.Namespace, out: TextIO) -> int:
    import warnings

    from .combinator import Role
    from .plugin_manager import PluginWarning, broken_plugins, combinators

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)  # listed below instead
        combinators()
    order = {role: i for i, role in enumerate(Role)}  # the kernel template's slot order
    entries = sorted(combinators().items(), key=lambda kv: (order[kv[1].combinator.role], kv[0]))
    rows = [(name, r.combinator.role.value, r.distribution, _first_line(r.combinator.doc))
            for name, r in entries]
    print(_table(rows, ("NAME", "ROLE", "DISTRIBUTION", "DESCRIPTION")), file=out)
    dists = sorted({r.distribution for _, r in entries})
    print(f"\n{len(rows)} combinators from {len(dists)} distribution(s): {', '.join(dists)}", file=out)
    broken = broken_plugins()
    if broken:
        print(f"\n{len(broken)} broken plugin(s), skipped:", file=out)
        for b in broken:
            print(f"  BROKEN  {b.describe()}", file=out)
    return 1 if broken and args.strict else 0


# --------------------------------------------------------------------------------------------------- show

def default_arch() -> str:
    """The local GPU's "sm<major><minor>" ("sm90" on an H100/H200), or "interpreter" without one."""
    import torch

    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm{major}{minor}"
    except Exception:  # a broken driver is no reason not to show a kernel
        pass
    return "interpreter"


def _arch(value: str) -> str:
    if value == "interpreter" or re.fullmatch(r"sm\d{2,3}a?", value):
        return value
    raise argparse.ArgumentTypeError(f"invalid arch {value!r}: use 'interpreter' or 'sm<major><minor>' "
                                     f"such as sm90 or sm80")


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def resolve_program(spec: str):
    """An example name, or ``module:attribute`` naming an AttentionProgram."""
    from .examples import EXAMPLES
    from .program import AttentionProgram

    if spec in EXAMPLES:
        return EXAMPLES[spec], f"attnfuse.examples:{spec}"
    if ":" not in spec:
        raise CLIError(f"unknown example {spec!r}; examples: {', '.join(EXAMPLES)} "
                       f"(or name a program as module:attribute)")
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CLIError(f"{spec!r}: expected module:attribute, e.g. mypackage.models:my_attention")
    added = os.getcwd() not in sys.path  # as `python -m` would, find modules in the current directory
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise CLIError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    finally:
        if added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise CLIError(f"module {module_name!r} has no attribute {attribute!r}")
        value = getattr(value, part)
    if not isinstance(value, AttentionProgram):
        raise CLIError(f"{spec} is a {type(value).__name__}, not an AttentionProgram; decorate the function "
                       f"with @af.attention")
    return value, spec


def _check_showable(program, spec: str) -> None:
    params = list(inspect.signature(program.fn).parameters.values())[3:]
    missing = [p.name for p in params if p.default is inspect.Parameter.empty]
    if missing:
        raise CLIError(f"{spec} takes extra argument(s) {', '.join(missing)} with no default; `show` needs a "
                       f"program whose extra arguments have defaults (it traces the program with them)")


def cmd_show(args: argparse.Namespace, out: TextIO) -> int:
    import attrs

    from . import ir
    from .passes.lower import KernelConfig, fragment_of
    from .runtime.inputs import MAX_HEAD_DIM
    from .runtime.launch import compile_forward, compiled_kernel

    program, spec = resolve_program(args.program)
    _check_showable(program, spec)
    graph = program.graph()
    arch = args.arch or default_arch()
    dtype = args.dtype or ("float32" if arch == "interpreter" else "bfloat16")
    head_dim_v = args.head_dim_v or args.head_dim
    for name, dim in (("--head-dim", args.head_dim), ("--head-dim-v", head_dim_v)):
        if dim > MAX_HEAD_DIM:
            raise CLIError(f"{name} must be at most {MAX_HEAD_DIM}, got {dim}")
    if args.lse and not fragment_of(graph.weights.apply).has_lse:
        raise CLIError(f"--lse needs a normaliser with a log-sum-exp; {graph.weights.apply.combinator} has none "
                       f"(softmax has)")
    training = args.kernel in ("dkdv", "dq")
    config = KernelConfig(arch=arch, dtype=dtype, head_dim=args.head_dim, head_dim_v=head_dim_v, group=args.group,
                          save_lse=args.lse or (training and fragment_of(graph.weights.apply).has_lse),
                          fp32_precision="ieee")
    kernel = compiled_kernel(graph, config, args.kernel)
    if args.path_only:
        print(kernel.path, file=out)
        return 0
    if args.source_only:
        out.write(kernel.source if kernel.source.endswith("\n") else kernel.source + "\n")
        return 0
    tiled = compile_forward(graph, config).tiled
    doc = _first_line(program.fn.__doc__ or "")
    listing = ir.render(graph)
    print(f"# program    {spec}" + (f"  ({doc})" if doc else ""), file=out)
    print("# IR", file=out)
    for line in listing.splitlines():
        print(f"    {line}", file=out)
    if ir.signature(graph) not in listing:
        print(f"    signature {ir.signature(graph)}", file=out)
    print("# kernel     " + " ".join(f"{k}={v}" for k, v in attrs.asdict(config).items()), file=out)
    tiles = " ".join(f"{k}={v}" for k, v in attrs.asdict(kernel.tiles).items())
    print(f"# tiles      {tiles} block_d={tiled.block_d} block_dv={tiled.block_dv}", file=out)
    print(f"# name       {kernel.name}", file=out)
    print(f"# path       {kernel.path}", file=out)
    print("# source", file=out)
    out.write(kernel.source if kernel.source.endswith("\n") else kernel.source + "\n")
    return 0


# --------------------------------------------------------------------------------------------------- demo

def _rotate_half(x):
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_float32(x, positions, theta: float = 10000.0):
    """x (B, H, N, D) rotated at ``positions`` (N,) in float32, NeoX half split as plugins/rope.py does."""
    import torch

    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)
    freqs = positions.to(torch.float64)[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().float(), angles.sin().float()
    x = x.float()
    return x * cos + _rotate_half(x) * sin


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
        with warnings.catch_warnings(), (sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()):
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

    from .examples import llama

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
    print(f"check   max abs error vs llama.reference (float64): {err:.2e} (tolerance {CPU_TOLERANCE:.0e}): "
          f"{'passed' if ok else 'FAILED'}", file=out)
    return 0 if ok else 1


def _demo_cuda(out: TextIO) -> int:
    import torch
    import triton.testing

    from .examples import llama

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
    print(f"check   max abs error vs float32 SDPA: {err:.2e} (bf16 SDPA's own {torch_err:.2e}, bound {bound:.2e}): "
          f"{'passed' if ok else 'FAILED'}", file=out)
    del ref, q32, k32

    flops = _causal_flops(B, Hq, N, D)
    print("timing  median of triton.testing.do_bench; causal FLOPs 4·B·Hq·D·N(N+1)/2; "
          "baselines get q, k pre-rotated", file=out)

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


# --------------------------------------------------------------------------------------------------- main

def cmd_new(args: argparse.Namespace, out: TextIO) -> int:
    from .scaffold import scaffold

    root = scaffold(args.name, args.role, args.dir)
    print(f"wrote {root}: pip install -e {root}[test] && pytest {root}", file=out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG, description="AttnFuse: compose attention from combinators, get one fused Triton kernel.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("list", help="list every registered combinator, and plugins skipped as broken")
    p.add_argument("--strict", action="store_true", help="exit 1 when a plugin is broken")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show a program's IR, kernel configuration and generated Triton source",
                       description="Show a program's IR, signature, kernel and tile configuration, and the "
                                   "generated Triton source (no tensors needed).")
    p.add_argument("program", metavar="PROGRAM",
                   help="an example name (llama, gpt2, mistral, alibi, relu) or module:attribute")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="input dtype (default: bfloat16 on a GPU arch, float32 for the interpreter)")
    p.add_argument("--head-dim", type=_positive_int, default=128, metavar="D", help="head dim of q and k (128)")
    p.add_argument("--head-dim-v", type=_positive_int, metavar="DV", help="head dim of v (default: D)")
    p.add_argument("--group", type=_positive_int, default=1, metavar="G", help="Hq // Hkv (1)")
    p.add_argument("--arch", type=_arch, metavar="ARCH",
                   help="interpreter, sm90, sm80, ... (default: the local GPU's, else interpreter)")
    p.add_argument("--lse", action="store_true", help="a kernel that also writes the log-sum-exp")
    p.add_argument("--kernel", choices=("forward", "decode", "dkdv", "dq", "transform"), default="forward",
                   help="which generated kernel: the forward (default), the split-KV decoding kernel, the "
                        "backward's dK/dV or dQ kernel, or the transform pass (q and k rows' qk transforms, hoisted)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--source-only", action="store_true", help="print the generated source alone")
    only.add_argument("--path-only", action="store_true", help="print the cached source file's path alone")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("new", help="write a pip-installable plugin package for a new combinator",
                       description="Write a plugin package: pyproject with the entry point, one module with "
                                   "every field of the role filled in and commented, a conformance test, a README.")
    p.add_argument("name", metavar="NAME", help="the combinator's name (af.NAME), a lower-case identifier")
    p.add_argument("--role", required=True, choices=("mask", "normaliser", "score_mod", "score_source", "transform"))
    p.add_argument("--dir", metavar="DIR", help="where to write it (default: ./attnfuse-NAME)")
    p.set_defaults(func=cmd_new)

    p = sub.add_parser("demo", help="run examples.llama, check it, and time it against PyTorch on a GPU")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="default: cuda when available (bf16, Llama-3-8B geometry), else cpu (interpreter)")
    p.set_defaults(func=cmd_demo)

    from .bench.command import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``attnfuse`` command; returns its exit code (0 ok, 1 a failed check, 2 an error)."""
    from .errors import AttnFuseError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse has printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return args.func(args, sys.stdout)
    except (CLIError, AttnFuseError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `attnfuse show ... | head`: stop quietly, as other Unix tools do
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
