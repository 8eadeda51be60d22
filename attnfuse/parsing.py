"""One lock for every Python parse AttnFuse runs: CPython 3.11's ast module keeps one recursion counter per
interpreter, so two threads parsing at once can raise a spurious SystemError (python/cpython#106905). The
fragment linter, the template's text rewrites and the interpreter's kernel rewrites all parse under it."""

from __future__ import annotations

import ast
import threading

PARSE_LOCK = threading.RLock()


def parse(code: str, mode: str = "exec") -> ast.AST:
    """``ast.parse(code, mode=mode)`` under ``PARSE_LOCK``."""
    with PARSE_LOCK:
        return ast.parse(code, mode=mode)
