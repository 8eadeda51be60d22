"""Kernel text helpers every code generator shares (a leaf module: it imports nothing of AttnFuse's)."""

from __future__ import annotations

import textwrap


def indent(code: str, spaces: int) -> str:
    """Dedent a block of code, then indent it by ``spaces``, ending in a newline; empty code stays empty."""
    code = textwrap.dedent(code).strip("\n")
    return textwrap.indent(code, " " * spaces) + "\n" if code else ""
