"""``attnfuse bench``: AttnFuse against SDPA (cuDNN, FlashAttention-2), compiled flex_attention and a
hand-written FA2 Triton kernel, in one process on the same inputs; a table, JSON, a plot, a docs page.
Needs a CUDA GPU (without one it says so and exits 2).

    attnfuse bench --suite forward --geometry llama3-8b --N 4096,8192 --json out.json --plot out.png
    python -m attnfuse.bench ...      (the same, for a tree whose attnfuse.cli has no bench command)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import tempfile
from typing import Sequence, TextIO

from .cases import BACKWARD_VARIANTS, FORWARD_VARIANTS, GEOMETRIES
from .rows import TABLE_SUITES

SUITES = (*TABLE_SUITES, "memory", "overhead")
# suites of features gated by architecture (runtime/gpu_gate.py): run by name; a GPU but sm90 needs their gate open
GATED_SUITES = ("packed", "fp8", "dropout")
DEFAULT_SUITES = [suite for suite in SUITES if suite not in GATED_SUITES]
DESCRIPTION = (
    "Time AttnFuse against SDPA (cuDNN, FlashAttention-2), compiled flex_attention and a hand-written "
    "FA2 Triton kernel, in one process on the same bf16 inputs; print a table, and optionally write "
    "JSON, a plot and the benchmark page. Needs a CUDA GPU."
)
NO_CUDA = (
    "bench needs a CUDA GPU: torch.cuda.is_available() is False here. Run it on a machine with "
    "one (`attnfuse demo` runs on the CPU)"
)


def _choices(allowed: Sequence[str], name: str):
    def parse(value: str) -> list[str]:
        chosen = list(allowed) if value == "all" else value.split(",")
        unknown = [c for c in chosen if c not in allowed]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(
                f"unknown {name} {', '.join(map(repr, unknown))}: use a comma-separated "
                f"list of {', '.join(allowed)}, or all"
            )
        return chosen

    return parse


def _sizes(value: str) -> list[int]:
    try:
        sizes = [int(n) for n in value.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {value!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suite",
        type=_choices(SUITES, "suite"),
        default=DEFAULT_SUITES,
        metavar="SUITES",
        help=f"comma-separated: {', '.join(SUITES)}, or all (default: all but {', '.join(GATED_SUITES)}, whose "
        "features a GPU other than sm90 runs only with their ATTNFUSE_*_ON_GPU=1)",
    )
    p.add_argument(
        "--geometry",
        type=_choices(tuple(GEOMETRIES), "geometry"),
        default=list(GEOMETRIES),
        metavar="G",
        help=f"forward and backward: {', '.join(GEOMETRIES)} (comma-separated; default all)",
    )
    p.add_argument("--N", type=_sizes, default=[2048, 4096, 8192, 16384], help="forward: sequence lengths")
    p.add_argument(
        "--variants",
        type=_choices(FORWARD_VARIANTS, "variant"),
        default=list(FORWARD_VARIANTS),
        help=f"forward: {', '.join(FORWARD_VARIANTS)}",
    )
    p.add_argument("--backward-N", type=_sizes, default=[2048, 4096, 8192], help="backward: sequence lengths")
    p.add_argument(
        "--backward-variants",
        type=_choices(BACKWARD_VARIANTS, "variant"),
        default=list(BACKWARD_VARIANTS),
        help=f"backward: {', '.join(BACKWARD_VARIANTS)}",
    )
    p.add_argument("--json", metavar="PATH", help="write every result row as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw TFLOP/s against N per variant (PNG; needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="write the benchmark page (docs/benchmarks.md)")
    p.add_argument(
        "--markdown-section",
        metavar="PATH",
        help="write each suite as a marked section (suite_NAME) of the page at PATH, leaving the rest of it",
    )


def add_bench_parser(sub) -> None:
    """Register ``bench`` on the ``attnfuse`` command's subparsers."""
    p = sub.add_parser(
        "bench", help="time AttnFuse against SDPA and flex_attention on a CUDA GPU", description=DESCRIPTION
    )
    add_arguments(p)
    p.set_defaults(func=cmd_bench)


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run, every option spelled out."""
    words = ["attnfuse", "bench", "--suite", ",".join(args.suite)]
    if {"forward", "backward"} & set(args.suite):
        words += ["--geometry", ",".join(args.geometry)]
    if "forward" in args.suite:
        words += ["--N", ",".join(map(str, args.N)), "--variants", ",".join(args.variants)]
    if "backward" in args.suite:
        words += [
            "--backward-N",
            ",".join(map(str, args.backward_N)),
            "--backward-variants",
            ",".join(args.backward_variants),
        ]
    for option in ("json", "plot", "markdown", "markdown_section"):
        if getattr(args, option):
            words += [f"--{option.replace('_', '-')}", getattr(args, option)]
    return shlex.join(words)


def run_meta(args: argparse.Namespace) -> dict[str, str]:
    import torch
    import triton

    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": command_line(args),
    }


def cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    if args.plot:
        from .plot import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            print(f"attnfuse: error: {exc}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print(f"attnfuse: error: {NO_CUDA}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cold-"))  # cold compiles
    os.environ.setdefault("ATTNFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="attnfuse-cold-"))
    from .run import run

    run(args, run_meta(args), out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnfuse.bench``: the bench command alone."""
    parser = argparse.ArgumentParser(prog="attnfuse bench", description=DESCRIPTION)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return cmd_bench(args, sys.stdout)
