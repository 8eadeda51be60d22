"""The ``attnfuse`` command: list the registered combinators, show a program's generated kernel, run a demo.

    attnfuse list
    attnfuse show llama --arch interpreter --dtype float32 --head-dim 32
    attnfuse show mypackage.models:my_attention --source-only > kernel.py
    attnfuse show mymodule:windowed --arg left=128 --input cos        (extra arguments: static, runtime)
    attnfuse demo
    attnfuse bench --suite forward --json out.json --plot out.png     (a CUDA GPU; attnfuse/bench/)
    attnfuse new prefix_lm --role mask
    attnfuse cache --info                                             (or --clear: the on-disk kernel cache)

One module per command (``listing``, ``show``, ``new``, ``demo``, ``cache``; ``bench`` is ``attnfuse.bench.command``),
each adding its subparser; this module builds the parser and runs the chosen command.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from . import cache, demo, listing, new, show
from .common import PROG, CLIError
from .demo import rope_float32
from .show import default_arch, resolve_program

__all__ = ["PROG", "CLIError", "build_parser", "default_arch", "main", "resolve_program", "rope_float32"]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from ..bench.command import add_bench_parser

    parser = argparse.ArgumentParser(
        prog=PROG, description="AttnFuse: compose attention from combinators, get one fused Triton kernel."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in (listing, show, new, demo, cache):
        command.add_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``attnfuse`` command; returns its exit code (0 ok, 1 a failed check, 2 an error)."""
    from ..errors import AttnFuseError

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
