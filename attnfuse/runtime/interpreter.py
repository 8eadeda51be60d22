"""CPU tensors run the generated kernels through Triton's interpreter, with no environment variable.

``InterpretedFunction`` runs a plain kernel function on CPU tensors. Triton's own library functions
(``tl.sum``, ``tl.max``, ``tl.zeros`` ...) are ``@triton.jit`` functions, which refuse to be called outside
a compiled kernel unless ``TRITON_INTERPRET=1`` was set before Triton was imported; while an interpreted
kernel runs, calls to them are routed to interpreted copies instead.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_lock = threading.RLock()
_interpreted: dict[Callable, InterpretedFunction] = {}


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    fn = _interpreted.get(self.fn)
    if fn is None:
        fn = _interpreted[self.fn] = InterpretedFunction(self.fn)
    return fn(*args, **kwargs)


@contextlib.contextmanager
def _jit_functions_interpreted():
    with _lock:
        original = JITFunction.__call__
        JITFunction.__call__ = _call_interpreted
        try:
            yield
        finally:
            JITFunction.__call__ = original


class InterpretedKernel:
    """``kernel[grid](*args, **constexprs)`` for a plain kernel function, on CPU tensors."""

    def __init__(self, fn: Callable):
        self._fn = InterpretedFunction(fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable:
        def launch(*args: Any, num_warps: int = 4, num_stages: int = 2, **constexprs: Any) -> None:
            with _jit_functions_interpreted():
                self._fn[grid](*args, **constexprs)
        return launch
