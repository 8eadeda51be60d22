"""CPU tensors run the generated kernels through Triton's interpreter, with no environment variable.

``InterpretedFunction`` runs a plain kernel function on CPU tensors. These patches hold while one runs, and
every patch (ours and Triton's) is undone when it returns:
Triton's own library functions (``tl.sum``, ``tl.max``, ``tl.zeros`` ...) are ``@triton.jit`` functions,
which refuse to be called outside a compiled kernel unless ``TRITON_INTERPRET=1`` was set before Triton
was imported, so calls to them go to interpreted copies (which share the patched ``triton.language`` of the
kernel that calls them, rather than patching it again on every call); a scalar used as an index (a loop bound)
converts through ``.item()``, since numpy >= 2.4 refuses ``int()`` of a one-element array
(triton-lang/triton#9171); the interpreter's float conversion (its private ``_convert_float``), which turns
float8 e4m3fn's NaN (bits s1111111) into 480 as if it were finite, keeps it NaN; and ``tl.device_assert``
runs (the builder's options say debug, without Triton's integer-overflow checks: Philox's products wrap by
design). A failed assertion of a plugin's declaration (its message starts with ``errors.DECLARATION_CHECK``:
``passes/codegen/scores.unit_weights_check``) raises ``DeclarationViolation``; Triton's own assertions stay errors
of the interpreter.

Every load and store is also bounds-checked: an address outside the storages of the kernel's tensor
arguments raises ``IndexError`` (on a GPU it would be an illegal memory access, or silent garbage).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import numpy as np
import triton.language as tl
import torch

from ..errors import DECLARATION_CHECK, DeclarationViolation
from ..parsing import PARSE_LOCK
from ..triton_compat import InterpretedFunction, InterpreterError, JITFunction, interpreter

_lock = PARSE_LOCK  # every rewrite parses the kernel's source
_interpreted: dict[Callable, InterpretedFunction] = {}


_patch_lang = interpreter._patch_lang
_patched_languages: set = set()  # the language modules (tl, tl.core) patched for the running launch
_launch_scopes: list = []  # their patch scopes, undone (last first) when the launch ends


class _UndoneWithTheLaunch:
    """The scope Triton's launch gets for its kernel's patches: ``_interpreter_patches`` undoes them, not it."""

    def restore(self) -> None:
        pass


_UNDONE_WITH_THE_LAUNCH = _UndoneWithTheLaunch()


def _patch_lang_for_the_launch(fn: Callable) -> _UndoneWithTheLaunch:
    """Triton's ``_patch_lang(fn)`` (the language modules ``fn`` sees, ``tl`` or ``tl.core``, go to the
    interpreter), done once per launch: the patches stay until the launch ends, so a helper called for every
    program and step finds them made. The scope returned leaves them to ``_interpreter_patches``."""
    languages = {value for value in fn.__globals__.values() if value is tl or value is tl.core}
    if not languages or not languages <= _patched_languages:
        _launch_scopes.append(_patch_lang(fn))
        _patched_languages.update(languages)
    return _UNDONE_WITH_THE_LAUNCH


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    """A ``@triton.jit`` helper called inside an interpreted kernel. ``InterpretedFunction.__call__``
    patches ``triton.language`` for the helper and never restores it (Triton 3.6), which left later
    compilations in the process broken; here the patches are undone when the launch ends."""
    fn = _interpreted.get(self.fn)
    if fn is None:
        fn = _interpreted[self.fn] = InterpretedFunction(self.fn)
    _patch_lang_for_the_launch(self.fn)
    try:
        return fn.rewrite()(*args, **kwargs)
    except Exception as exc:
        raise InterpreterError(repr(exc)) from exc


_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor_with_item_index(tensor, scope) -> None:
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


_convert_float = interpreter._convert_float


def _convert_float_keeping_e4m3_nan(data: np.ndarray, from_dtype: Any, to_dtype: Any, rounding_mode: Any) -> np.ndarray:
    """The interpreter's conversion of ``data`` (the bits of ``from_dtype`` values) to ``to_dtype``'s bits, with
    e4m3fn's NaN converted to NaN."""
    out = _convert_float(data, from_dtype, to_dtype, rounding_mode)
    if from_dtype != tl.float8e4nv or to_dtype.primitive_bitwidth <= 8:
        return out
    nan = (np.frombuffer(data.tobytes(), dtype=np.uint8).reshape(data.shape) & 0x7F) == 0x7F
    if not nan.any():
        return out
    mantissa = to_dtype.fp_mantissa_width
    exponent = to_dtype.primitive_bitwidth - mantissa - 1
    quiet_nan = ((1 << exponent) - 1) << mantissa | 1 << (mantissa - 1)
    return np.where(nan, np.array(quiet_nan, dtype=out.dtype), out)


_builder = interpreter.interpreter_builder
_masked_load, _masked_store = _builder.create_masked_load, _builder.create_masked_store
_unchecked = _builder.options
_asserting = interpreter.InterpreterOptions(debug=True, sanitize_overflow=False)  # device assertions run


def _check_bounds(ranges: np.ndarray, ptrs: Any, mask: Any, what: str) -> None:
    """Raise unless every address ``ptrs`` touches where ``mask`` holds lies in one of ``ranges`` (n, 2)."""
    size = ptrs.get_element_ty().primitive_bitwidth // 8
    addresses = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
    active = addresses[np.broadcast_to(mask.data, addresses.shape)].astype(np.uint64)
    if active.size == 0:
        return
    inside = ((active[:, None] >= ranges[None, :, 0]) & (active[:, None] + size <= ranges[None, :, 1])).any(axis=1)
    if not inside.all():
        bad = active[~inside]
        raise IndexError(
            f"out-of-bounds {what} of {bad.size} element(s), first at address {int(bad[0]):#x}; "
            f"the tensor arguments span {[(hex(int(a)), hex(int(b))) for a, b in ranges]}"
        )


def _storage_ranges(args: tuple) -> np.ndarray:
    spans = {
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in args if isinstance(t, torch.Tensor)
    }
    return np.array([(p, p + n) for p, n in spans] or np.empty((0, 2)), dtype=np.uint64).reshape(-1, 2)


@contextlib.contextmanager
def _interpreter_patches(args: tuple):
    ranges = _storage_ranges(args)

    def masked_load(ptrs, mask, *rest):
        _check_bounds(ranges, ptrs, mask, "load")
        return _masked_load(ptrs, mask, *rest)

    def masked_store(ptrs, value, mask, *rest):
        _check_bounds(ranges, ptrs, mask, "store")
        return _masked_store(ptrs, value, mask, *rest)

    with _lock:
        original_call = JITFunction.__call__
        JITFunction.__call__ = _call_interpreted
        interpreter._patch_lang = _patch_lang_for_the_launch  # the kernel's own, which its helpers then share
        interpreter._patch_lang_tensor = _patch_lang_tensor_with_item_index
        interpreter._convert_float = _convert_float_keeping_e4m3_nan
        _builder.create_masked_load, _builder.create_masked_store = masked_load, masked_store
        _builder.options = _asserting
        try:
            yield
        finally:
            while _launch_scopes:
                _launch_scopes.pop().restore()
            _patched_languages.clear()
            JITFunction.__call__ = original_call
            interpreter._patch_lang = _patch_lang
            interpreter._patch_lang_tensor = _patch_lang_tensor
            interpreter._convert_float = _convert_float
            _builder.create_masked_load, _builder.create_masked_store = _masked_load, _masked_store
            _builder.options = _unchecked


class InterpretedKernel:
    """A plain kernel function run by Triton's interpreter on CPU tensors, launched as ``Launcher``'s."""

    def __init__(self, fn: Callable):
        self._fn = InterpretedFunction(fn)
        self._fn.rewritten_fn = {}  # its own: Triton's class-wide dict would keep every kernel ever loaded alive
        # Rewritten now, while fn's source is registered, and under the lock like every other rewrite (a
        # helper's, at launch) and every other parse of AttnFuse's (``parsing.PARSE_LOCK``).
        with _lock:
            self._fn.rewrite()

    def launch(
        self,
        grid: tuple[int, ...],
        args: tuple,
        constexprs: dict[str, Any],
        num_warps: int = 4,
        num_stages: int = 2,
        device: Any = None,
        maxnreg: int | None = None,
    ) -> None:
        """Run on ``grid`` (warps, stages, device and a register cap mean nothing to the interpreter). numpy's
        floating-point warnings (log(0) = -inf for a masked row, say), and the interpreter's own RuntimeWarnings
        about them (an all-NaN max of a row that keeps no key), are silenced for the launch, as a GPU raises none."""
        with _interpreter_patches(args), np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
            try:
                self._fn[grid](*args, **constexprs)
            except InterpreterError as exc:
                if isinstance(exc.__cause__, IndexError):  # an out-of-bounds access: say so plainly
                    raise exc.__cause__ from None
                message = str(exc.__cause__)
                if isinstance(exc.__cause__, AssertionError) and message.startswith(DECLARATION_CHECK):
                    raise DeclarationViolation(message.removeprefix(DECLARATION_CHECK)) from None
                raise
