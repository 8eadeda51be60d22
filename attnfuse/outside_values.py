"""What an ``@af.attention`` function reads from outside its arguments: closure cells and module globals.

A program is traced once per configuration and what it reads is baked into the kernel, so a value read from
an enclosing scope (``cfg["scale"]``) or a global (``WINDOW``) is frozen into the trace key: a changed value
retraces. Code (functions, combinators) inside such values counts by identity, so a program built from a list
of combinators works. Values that cannot be frozen (tensors, other objects) are a ProgramError: pass them as
arguments.
"""
from __future__ import annotations

import builtins
import dis
import types
from typing import Any, Callable

from .errors import ProgramError

_CODE_TYPES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)


def freeze(value: Any, by_identity: tuple[type, ...] = ()) -> Any:
    """A hashable key for a static value that tells its type apart (``True``, ``1`` and ``1.0`` differ):
    None, bool, int, float, str, and tuples, lists and dicts of those; objects of the ``by_identity`` types
    (code: functions, combinators) stand for themselves. Raises TypeError naming any other type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value), value
    if isinstance(value, (tuple, list)):
        return type(value), tuple(freeze(v, by_identity) for v in value)
    if isinstance(value, dict):
        return dict, tuple((freeze(k, by_identity), freeze(v, by_identity)) for k, v in value.items())
    if isinstance(value, by_identity):
        return type(value), id(value)  # the program keeps it alive through its closure or globals
    raise TypeError(type(value).__name__)


def _global_loads(code: types.CodeType) -> list[str]:
    """Names ``code`` and the functions and lambdas defined in it load as globals."""
    names = [ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_loads(const)
    return list(dict.fromkeys(names))


class OutsideReads:
    """The closure variables and globals ``fn`` (and what it defines) reads, found once at decoration.

    Names bound to code (modules, functions, classes, and the ``ignored`` types: combinators, programs) or to
    builtins are left out then, so a program that reads only those adds no work per call.
    """

    def __init__(self, fn: Callable, ignored: tuple[type, ...]):
        self._ignored = _CODE_TYPES + ignored
        self._name = getattr(fn, "__qualname__", repr(fn))
        code = getattr(fn, "__code__", None)  # None: a callable object, whose reads are not inspected
        self._globals = getattr(fn, "__globals__", {})
        cells = zip(code.co_freevars, fn.__closure__ or ()) if code else ()
        self._cells = tuple((n, c) for n, c in cells if not self._is_code(_contents(c)))
        self._global_names = tuple(
            n for n in (_global_loads(code) if code else ())
            if not (self._is_code(self._globals.get(n, _EMPTY)) or (n not in self._globals and hasattr(builtins, n))))
        self.empty = not self._cells and not self._global_names

    def _is_code(self, value: Any) -> bool:
        return isinstance(value, self._ignored)

    def key(self) -> tuple:
        """The frozen values read now, by name; () when the function reads none."""
        if self.empty:
            return ()
        found = [(n, "the closure variable", _contents(c)) for n, c in self._cells]
        found += [(n, "the global", self._globals.get(n, _EMPTY)) for n in self._global_names]
        key = []
        for name, what, value in found:
            if value is _EMPTY or self._is_code(value):
                continue
            try:
                key.append((name, freeze(value, self._ignored)))
            except TypeError as exc:
                raise ProgramError(
                    f"{self._name} reads {what} {name!r}, which holds a {exc}: a program is "
                    f"traced once and what it reads from outside its arguments is baked into the kernel, so such "
                    f"a value must be None, bool, int, float, str, or a tuple, list or dict of those; pass {name!r} "
                    f"as an argument of the program instead") from None
        return tuple(key)


class _Empty:
    """An unassigned closure cell or undefined global (the function itself raises NameError if it reads one)."""


_EMPTY: Any = _Empty()


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY
