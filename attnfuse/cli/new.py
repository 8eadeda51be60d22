"""``attnfuse new``: write a plugin package for a new combinator (the templates are in attnfuse/scaffold)."""

from __future__ import annotations

import argparse
from typing import TextIO


def cmd_new(args: argparse.Namespace, out: TextIO) -> int:
    from ..scaffold import scaffold

    root = scaffold(args.name, args.role, args.dir)
    print(f"wrote {root}: pip install -e {root}[test] && pytest {root}", file=out)
    return 0


def add_parser(sub) -> None:
    """Add ``new`` to the command's subparsers."""
    p = sub.add_parser(
        "new",
        help="write a pip-installable plugin package for a new combinator",
        description="Write a plugin package: pyproject with the entry point, one module with "
        "every field of the role filled in and commented, a conformance test, a README.",
    )
    p.add_argument(
        "name",
        metavar="NAME",
        help="the combinator's name (af.NAME), a lower-case identifier that no "
        "registered combinator and no name of attnfuse's own API has",
    )
    p.add_argument("--role", required=True, choices=("mask", "normaliser", "score_mod", "score_source", "transform"))
    p.add_argument("--dir", metavar="DIR", help="where to write it (default: ./attnfuse-NAME)")
    p.set_defaults(func=cmd_new)
