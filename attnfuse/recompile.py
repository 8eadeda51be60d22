"""The recompile warning: a program traced for more than ``RECOMPILE_LIMIT`` static configurations warns once.

Every new static value of an extra argument (or changed value the program reads from a closure or global)
traces the program again and compiles new kernels, seconds each on a GPU. A value that changes from call to
call belongs in a tensor argument (a runtime input). Raise the limit with
``attnfuse.recompile.RECOMPILE_LIMIT = 32``, or silence the warning with
``warnings.filterwarnings("ignore", category=attnfuse.RecompileWarning)``.
"""
from __future__ import annotations

import threading

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

    def warning(self) -> str | None:
        """The warning's message, the first time the count is past ``RECOMPILE_LIMIT``; else None."""
        with self._lock:
            if self._warned or self._count <= RECOMPILE_LIMIT:
                return None
            self._warned = True
            changed = ", ".join(n if n == OUTSIDE else repr(n) for n in self._changed)
        return (f"program {self._program} has been traced for {self._count} static configurations (more than "
                f"attnfuse.recompile.RECOMPILE_LIMIT = {RECOMPILE_LIMIT}); changing: {changed}. Each new value "
                f"traces it again and compiles new kernels: pass a value that changes between calls as a tensor "
                f"argument (a runtime input), or raise attnfuse.recompile.RECOMPILE_LIMIT")
