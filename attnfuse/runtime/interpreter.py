"""CPU tensors run the generated kernels through Triton's interpreter, with no environment variable.

``InterpretedFunction`` runs a plain kernel function on CPU tensors. Two patches hold while one runs:
Triton's own library functions (``tl.sum``, ``tl.max``, ``tl.zeros`` ...) are ``@triton.jit`` functions,
which refuse to be called outside a compiled kernel unless ``TRITON_INTERPRET=1`` was set before Triton
was imported, so calls to them go to interpreted copies; and a scalar used as an index (a loop bound)
converts through ``.item()``, since numpy >= 2.4 refuses ``int()`` of a one-element array
(triton-lang/triton#9171).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_lock = threading.RLock()
_interpreted: dict[Callable, InterpretedFunction] = {}


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    fn = _interpreted.get(self.fn)
    if fn is None:
        fn = _interpreted[self.fn] = InterpretedFunction(self.fn)
    return fn(*args, **kwargs)


_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor_with_item_index(tensor, scope) -> None:
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


@contextlib.contextmanager
def _interpreter_patches():
    with _lock:
        original_call = JITFunction.__call__
        JITFunction.__call__ = _call_interpreted
        interpreter._patch_lang_tensor = _patch_lang_tensor_with_item_index
        try:
            yield
        finally:
            JITFunction.__call__ = original_call
            interpreter._patch_lang_tensor = _patch_lang_tensor


class InterpretedKernel:
    """``kernel[grid](*args, **constexprs)`` for a plain kernel function, on CPU tensors."""

    def __init__(self, fn: Callable):
        self._fn = InterpretedFunction(fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable:
        def launch(*args: Any, num_warps: int = 4, num_stages: int = 2, **constexprs: Any) -> None:
            with _interpreter_patches():
                self._fn[grid](*args, **constexprs)
        return launch
