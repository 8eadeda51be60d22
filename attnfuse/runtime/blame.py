"""Name the plugin behind an error raised inside a generated kernel (by Triton's compiler or interpreter).

Codegen precedes every fragment with a comment ``# <combinator>_<i>: <what>``; the error's line in the
generated file, found from the traceback (interpreter) or the compiler's AST node (Triton), is traced back
to the nearest such comment above it.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

from .source_cache import code_filename

_FRAGMENT_COMMENT = re.compile(r"^\s*# ((\w+?)_\d+): (.*)$")


def _line(source: str, path: Path, name: str, exc: BaseException) -> int | None:
    """The 1-based line of ``source`` the error points at, if it can be found."""
    cause: BaseException | None = exc
    while cause is not None:  # the interpreter wraps the error raised in the kernel
        frames = [f for f in traceback.extract_tb(cause.__traceback__) if f.filename == code_filename(path)]
        if frames:
            return frames[-1].lineno
        cause = cause.__cause__
    node = getattr(exc, "node", None)  # triton.compiler.errors.CompilationError: relative to the def
    if getattr(node, "lineno", None) is not None:
        lines = source.splitlines()
        start = next((i for i, text in enumerate(lines) if text.startswith(f"def {name}(")), None)
        if start is not None:
            return start + node.lineno
    return None


def blame(source: str, path: Path, name: str, exc: BaseException, origins: dict[str, str]) -> str | None:
    """A sentence naming the combinator (and its distribution, from ``origins``: by application prefix) whose
    fragment holds the failing line."""
    line = _line(source, path, name, exc)
    lines = source.splitlines()
    if line is None or not 1 <= line <= len(lines):
        return None
    for text in reversed(lines[:line]):
        found = _FRAGMENT_COMMENT.match(text)
        if found:
            application, combinator, what = found.groups()
            dist = f" of distribution {origins[application]!r}" if application in origins else ""
            return (
                f"the failing line is in the fragment of combinator {combinator!r}{dist} ({application}: "
                f"{what}): {path}:{line}: {lines[line - 1].strip()}"
            )
        if text.startswith("def "):
            break
    return None
