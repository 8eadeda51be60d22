"""What every ``attnfuse`` command shares: the program name, the usage error, a docstring's first line."""

from __future__ import annotations

PROG = "attnfuse"


class CLIError(Exception):
    """A usage error: printed as ``attnfuse: error: ...``, exit code 2."""


def first_line(doc: str) -> str:
    """The first non-blank line of ``doc``, stripped ("" when there is none)."""
    for line in (doc or "").strip().splitlines():
        if line.strip():
            return line.strip()
    return ""
