"""The recompile warning: a program traced for more than ``RECOMPILE_LIMIT`` static configurations warns once.

Every new static value of an extra argument (or changed value the program reads from a closure or global)
traces the program again and compiles new kernels, seconds each on a GPU. A value that changes from call to
call belongs in a tensor argument (a runtime input) where the combinator's parameter it feeds takes one
(``Param(runtime=True)``); the warning says, for each argument that changed, whether it can. Raise the limit with
``attnfuse.recompile.RECOMPILE_LIMIT = 32``, or silence the warning with
``warnings.filterwarnings("ignore", category=attnfuse.RecompileWarning)``.
"""

from __future__ import annotations

import threading
from typing import Callable

RECOMPILE_LIMIT = 8  # as torch.compile's default recompile_limit
OUTSIDE = "values it reads from closures or globals"


class RecompileWarning(UserWarning):
    """A program keeps being traced (and compiled) again for new static values."""


class Recompiles:
    """One program's count of traces, and which of its static arguments differ from the first trace's."""

    def __init__(self, program: str, arg_names: tuple[str, ...]):
        self._program = program
        self._arg_names = arg_names
        self._lock = threading.Lock()
        self._first: tuple | None = None
        self._count = 0
        self._changed: dict[str, None] = {}  # an ordered set
        self._warned = False

    def traced(self, statics: tuple, outside: tuple) -> None:
        """Count a new trace: ``statics`` the frozen static arguments, ``outside`` the rest of its key (the
        values read from closures and globals)."""
        with self._lock:
            self._count += 1
            if self._first is None:
                self._first = statics, outside
                return
            first_statics, first_outside = self._first
            self._changed.update((n, None) for n, a, b in zip(self._arg_names, first_statics, statics) if a != b)
            if outside != first_outside:
                self._changed[OUTSIDE] = None

    def warning(self, static_only: Callable[[str], str | None]) -> str | None:
        """The warning's message, the first time the count is past ``RECOMPILE_LIMIT``; else None.
        ``static_only(name)``: why the extra argument ``name`` cannot be a runtime tensor (it feeds a parameter
        that the combinator's declaration makes static), or None when it can; called only for the message."""
        with self._lock:
            if self._warned or self._count <= RECOMPILE_LIMIT:
                return None
            self._warned = True
            changed = list(self._changed)
        head = (
            f"program {self._program} has been traced for {self._count} static configurations (more than "
            f"attnfuse.recompile.RECOMPILE_LIMIT = {RECOMPILE_LIMIT}); changing: "
            f"{', '.join(n if n == OUTSIDE else repr(n) for n in changed)}. Each new value traces it again and "
            f"compiles new kernels. "
        )
        advice, static = [], []
        for name in changed:
            if name == OUTSIDE:
                advice.append(
                    "Pass a value read from a closure or global as an argument of the program instead, "
                    "a tensor where a combinator's parameter takes a runtime tensor. "
                )
                continue
            reason = static_only(name)
            if reason is None:
                advice.append(
                    f"{name!r} may be a runtime input: pass it as a tensor argument and a new value compiles nothing. "
                )
            else:
                static.append(name)
                advice.append(f"{name!r} can only be static ({reason}): each of its values is a kernel of its own. ")
        tail = (
            "Use fewer distinct values, or raise attnfuse.recompile.RECOMPILE_LIMIT"
            if static
            else "Or raise attnfuse.recompile.RECOMPILE_LIMIT"
        )
        return head + "".join(advice) + tail
