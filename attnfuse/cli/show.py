"""``attnfuse show``: a program's IR, kernel and tile configuration, and its generated Triton source."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import re
import sys
from typing import TextIO

from .common import CLIError, first_line


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
    raise argparse.ArgumentTypeError(
        f"invalid arch {value!r}: use 'interpreter' or 'sm<major><minor>' such as sm90 or sm80"
    )


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
    from ..examples import EXAMPLES
    from ..program import AttentionProgram

    if spec in EXAMPLES:
        return EXAMPLES[spec], f"attnfuse.examples:{spec}"
    if ":" not in spec:
        raise CLIError(
            f"unknown example {spec!r}; examples: {', '.join(EXAMPLES)} (or name a program as module:attribute)"
        )
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
    except SystemExit as exc:  # sys.exit() at import: a script, not a module defining programs
        raise CLIError(
            f"module {module_name!r} exited while it was imported (SystemExit, code {exc.code!r}), before "
            f"`show` could read {attribute!r}; keep a script's code under `if __name__ == "
            f'"__main__":`'
        ) from None
    finally:
        if added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise CLIError(f"module {module_name!r} has no attribute {attribute!r}")
        value = getattr(value, part)
    if not isinstance(value, AttentionProgram):
        raise CLIError(
            f"{spec} is a {type(value).__name__}, not an AttentionProgram; decorate the function with @af.attention"
        )
    return value, spec


class RuntimePlaceholder:
    """Stands for a runtime input (a tensor or BlockMask) while `show` traces a program: the kernel depends on
    which runtime inputs are given, not on their values, shapes or dtypes (a combinator's declaration fixes
    each tensor's rank; strides are kernel arguments)."""

    __attnfuse_runtime_input__ = True

    def __repr__(self) -> str:
        return "<runtime input>"


def _static(text: str):
    """An ``--arg`` VALUE: a Python literal (None, True, 3, 0.5, 'neox'), or a bare word as a str."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text):
            return text
        raise CLIError(
            f"--arg: VALUE {text!r} is not a Python literal (None, True, 3, 0.5, 'neox') or a word"
        ) from None


def _arguments(program, spec: str, statics: list[str], inputs: list[str]) -> dict:
    """The extra arguments `show` traces ``program`` with: ``--arg NAME=VALUE`` static values, ``--input NAME``
    runtime inputs, and for each argument with no default given neither, a runtime input (a placeholder)."""
    params = list(inspect.signature(program.fn).parameters.values())[3:]
    names = [p.name for p in params]
    allowed = f"{spec} takes the extra argument(s) {', '.join(names)}" if names else f"{spec} takes no extra argument"
    chosen: dict = {}
    for item in statics:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise CLIError(f"--arg: expected NAME=VALUE, got {item!r}")
        chosen[name] = _static(text)
    for name in inputs:
        if name in chosen:
            raise CLIError(f"--input {name}: {name!r} has a static value from --arg already; give it once")
        chosen[name] = RuntimePlaceholder()
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise CLIError(
            f"--arg/--input: {', '.join(map(repr, unknown))} "
            f"{'is no argument' if len(unknown) == 1 else 'are no arguments'} of the program: {allowed}"
        )
    for p in params:
        if p.name not in chosen and p.default is inspect.Parameter.empty:
            chosen[p.name] = RuntimePlaceholder()
    return chosen


def _graph(program, spec: str, arguments: dict):
    """The program's graph for ``arguments``; a ProgramError from a placeholder feeding a static parameter
    says how to give that argument's value."""
    from ..errors import ProgramError

    try:
        return program.graph(**arguments)
    except ProgramError as exc:
        placeholders = [n for n, v in arguments.items() if isinstance(v, RuntimePlaceholder)]
        if not placeholders:
            raise
        raise ProgramError(
            f"{exc} (`show` traced {spec} with {', '.join(placeholders)} as runtime input(s); give a "
            f"static argument's value with --arg NAME=VALUE)"
        ) from None


def cmd_show(args: argparse.Namespace, out: TextIO) -> int:
    import attrs

    from .. import ir
    from ..kernels.verified import MODE_ENV, mode
    from ..plan import KernelConfig
    from ..runtime.compiled import compiled
    from ..runtime.inputs import MAX_HEAD_DIM
    from .engines import call_engines, with_resources
    from .transforms import TransformChoice

    if args.json and args.kernel is not None:
        raise CLIError("--json reports every kernel of a call; --kernel picks the one whose source the text shows")
    kind = args.kernel or "forward"
    program, spec = resolve_program(args.program)
    arguments = _arguments(program, spec, args.arg, args.input)
    graph = _graph(program, spec, arguments)
    arch = args.arch or default_arch()
    if args.resources and arch not in ("sm90", "sm90a"):
        raise CLIError(
            f"--resources compiles the kernels for an H100/H200 with no GPU: give --arch sm90, not {arch!r}"
            + (" (the default: no GPU here)" if args.arch is None else "")
        )
    if args.resources and (args.source_only or args.path_only):
        raise CLIError(
            "--resources reports in the engines section (or with --json), not with --source-only/--path-only"
        )
    given = [f"--{n}" for n in ("kv-lens", "positions", "varlen") if getattr(args, n.replace("-", "_"))]
    if len(given) > 1:
        raise CLIError(
            f"{' and '.join(given)} describe calls that cannot be combined: a call gives kv_lens, q_offset/k_offset "
            "or cu_seqlens_q/cu_seqlens_k, one of them"
        )
    dtype = args.dtype or ("float32" if arch == "interpreter" else "bfloat16")
    head_dim_v = args.head_dim_v or args.head_dim
    for name, dim in (("--head-dim", args.head_dim), ("--head-dim-v", head_dim_v)):
        if dim > MAX_HEAD_DIM:
            raise CLIError(f"{name} must be at most {MAX_HEAD_DIM}, got {dim}")
    has_lse = graph.has_lse
    if args.lse and not has_lse:
        raise CLIError(
            f"--lse needs a normaliser with a log-sum-exp; {graph.weights.apply.combinator} has none (softmax has)"
        )
    inference = KernelConfig(
        arch=arch,
        dtype=dtype,
        head_dim=args.head_dim,
        head_dim_v=head_dim_v,
        group=args.group,
        save_lse=args.lse,
        fp32_precision="ieee",
        kv_lens=args.kv_lens,
        positions=args.positions,
        varlen=args.varlen,
        dropout=args.dropout,
    )
    training = attrs.evolve(inference, save_lse=args.lse or has_lse)
    config = training if kind in ("dkdv", "dq") else inference

    transforms = TransformChoice.of(graph, inference)

    def engines_of_call() -> dict:
        engines = call_engines(graph, inference, training)
        if not args.resources:
            return engines
        never = ("dkdv", "dq") if inference.dtype.startswith("float8") else ()  # a float8 call has no backward
        return {k: engine if k in never else with_resources(engine, graph) for k, engine in engines.items()}

    if args.json:
        report = {
            "program": spec,
            "arguments": {n: repr(v) for n, v in arguments.items()},
            "config": attrs.asdict(inference),
            "templates": mode(),
            "kernels": {k: engine.fields() for k, engine in engines_of_call().items()},
            "transforms": transforms.fields() if transforms is not None else None,
        }
        json.dump(report, out, indent=2)
        out.write("\n")
        return 0
    program_kernels = compiled(graph, config)
    kernel = program_kernels.kernel(kind)
    if args.path_only:
        print(kernel.path, file=out)
        return 0
    if args.source_only:
        out.write(kernel.source if kernel.source.endswith("\n") else kernel.source + "\n")
        return 0
    engines = engines_of_call()
    doc = first_line(program.fn.__doc__ or "")
    listing = ir.render(graph)
    print(f"# program    {spec}" + (f"  ({doc})" if doc else ""), file=out)
    if arguments:
        print("# arguments  " + ", ".join(f"{n}={v!r}" for n, v in arguments.items()), file=out)
    print("# IR", file=out)
    for line in listing.splitlines():
        print(f"    {line}", file=out)
    if ir.signature(graph) not in listing:
        print(f"    signature {ir.signature(graph)}", file=out)
    print("# kernel     " + " ".join(f"{k}={v}" for k, v in attrs.asdict(config).items()), file=out)
    tiles = " ".join(f"{k}={v}" for k, v in attrs.asdict(kernel.tiles).items())
    widths = kernel.spec.launch.constants
    print(f"# tiles      {tiles} block_d={widths['BLOCK_D']} block_dv={widths['BLOCK_DV']}", file=out)
    print(f"# name       {kernel.name}", file=out)
    print(f"# path       {kernel.path}", file=out)
    print(f"# engines    ({MODE_ENV}={mode()})", file=out)
    for line in (line for engine in engines.values() for line in engine.lines()):
        print(f"    {line}", file=out)
    if transforms is not None:
        print("# transforms", file=out)
        for line in transforms.lines():
            print(f"    {line}", file=out)
    print("# source", file=out)
    out.write(kernel.source if kernel.source.endswith("\n") else kernel.source + "\n")
    return 0


def add_parser(sub) -> None:
    """Add ``show`` to the command's subparsers."""
    p = sub.add_parser(
        "show",
        help="show a program's IR, kernel configuration and generated Triton source",
        description="Show a program's IR, signature, kernel and tile configuration, and the "
        "generated Triton source (no tensors needed). Extra arguments with no default are "
        "traced as runtime inputs (the kernel depends on which are given, not on their "
        "shapes); --arg gives a static one's value, --input makes a defaulted one a "
        "runtime input.",
    )
    p.add_argument(
        "program", metavar="PROGRAM", help="an example name (llama, gpt2, mistral, alibi, relu) or module:attribute"
    )
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"),
        help="input dtype (default: bfloat16 on a GPU arch, float32 for the interpreter)",
    )
    p.add_argument("--head-dim", type=_positive_int, default=128, metavar="D", help="head dim of q and k (128)")
    p.add_argument("--head-dim-v", type=_positive_int, metavar="DV", help="head dim of v (default: D)")
    p.add_argument("--group", type=_positive_int, default=1, metavar="G", help="Hq // Hkv (1)")
    p.add_argument(
        "--arch",
        type=_arch,
        metavar="ARCH",
        help="interpreter, sm90, sm80, ... (default: the local GPU's, else interpreter)",
    )
    p.add_argument("--lse", action="store_true", help="a kernel that also writes the log-sum-exp")
    p.add_argument(
        "--kv-lens",
        action="store_true",
        help="the kernels of a call with per-sequence key counts (kv_lens: a KV cache's lengths)",
    )
    p.add_argument(
        "--positions",
        action="store_true",
        help="the kernels of a call with given positions (q_offset, k_offset, seq_len: a chunk of a longer sequence)",
    )
    p.add_argument(
        "--varlen",
        action="store_true",
        help="a packed call's kernels (cu_seqlens_q, cu_seqlens_k: documents in one row)",
    )
    p.add_argument(
        "--dropout",
        action="store_true",
        help="the kernels of a call with attention dropout (dropout_p > 0: a Philox mask on the weights)",
    )
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a static extra argument of the program: a Python literal (None, True, 3, 0.5, 'neox') or "
        "a word; repeatable",
    )
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME",
        help="an extra argument given as a runtime input (a tensor or BlockMask), such as rope's cos and "
        "sin; repeatable. Arguments with no default and no --arg are runtime inputs already",
    )
    p.add_argument(
        "--kernel",
        choices=("forward", "decode", "dkdv", "dq", "transform"),
        help="which generated kernel: the forward (default), the split-KV decoding kernel, the "
        "backward's dK/dV or dQ kernel, or the transform pass (q and k rows' qk transforms, hoisted)",
    )
    only = p.add_mutually_exclusive_group()
    only.add_argument("--source-only", action="store_true", help="print the generated source alone")
    only.add_argument("--path-only", action="store_true", help="print the cached source file's path alone")
    only.add_argument(
        "--json",
        action="store_true",
        help="print, as JSON, the engine that runs each kernel of a call (a Hopper template instance "
        "or the generated kernel) and why",
    )
    p.add_argument(
        "--resources",
        action="store_true",
        help="with each kernel's engine, its registers, spill bytes and shared memory on an H100/H200 (needs --arch "
        "sm90), compiled with no GPU: a template instance or a generated kernel (seconds a kernel)",
    )
    p.set_defaults(func=cmd_show)
