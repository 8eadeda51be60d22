"""What an ``@af.attention`` function reads from outside its arguments, found from its bytecode.

A program is traced once per configuration and what it reads is baked into the kernel, so every value it
reads from outside its arguments is part of the trace key: a changed value traces again. The reads are
found once, at decoration, from the bytecode (``dis``) of the function and of every plain Python function
of user code it reaches (not AttnFuse's, torch's, triton's, numpy's or the standard library's):

* the closure cells and module globals it loads, in its own code and in the functions defined in it;
* attribute chains rooted at one of those bound to a module or class of user code (``Cfg.left``,
  ``cfgmod.SCALE``, ``pkg.mod.X``);
* the same, recursively, in the functions those reads reach (helpers, called by name or through a chain).

Each call resolves only those paths and freezes their values. Code in them counts by identity, so a
rebound helper traces again (and is analysed anew). A value that cannot be frozen (a tensor, another
object), and a read the analysis cannot follow (a module of user code imported inside a function, a user
module or class used as a value rather than through its attributes, a bound method, ``globals()``,
``vars()``, ``eval``, ``exec``, ``__import__``), is a ProgramError: pass such values as arguments.

The standard library is fixed code only where it holds no state (``FIXED_STDLIB``: math, operator,
functools ...). A read of any other standard-library module, of its code or of its objects (``os.environ``,
``os.getenv``, ``time.time``, ``random.random``, ``sys.argv``, ``datetime.datetime.now``), an import of one
inside a function, and a call of ``open`` or ``input`` is a ProgramError naming the read: what such a call
returns can change between calls, and no key could follow it.
"""

from __future__ import annotations

import builtins
import dis
import enum
import os
import sys
import sysconfig
import types
from typing import Any, Callable, Iterator

from .errors import ProgramError

LIBRARIES = frozenset({"attnfuse", "attnfuse_plugins", "torch", "triton", "numpy", "builtins"})
"""Top-level packages whose code is taken as fixed, with the standard library's: their functions are not
analysed, their modules' attributes are not read per call."""
_STDLIB = os.path.join(os.path.realpath(sysconfig.get_paths()["stdlib"]), "")
_libraries: dict[str, tuple[Any, bool]] = {}  # by top-level name: (the module it was found for, whether a library)

_OPAQUE_BUILTINS = frozenset({"globals", "vars", "eval", "exec", "__import__"})
_STATE_BUILTINS = frozenset({"open", "input"})  # read files and the terminal
FIXED_STDLIB = frozenset(
    {
        "math",
        "cmath",
        "operator",
        "functools",
        "itertools",
        "numbers",
        "enum",
        "typing",
        "types",
        "dataclasses",
        "collections",
        "abc",
        "string",
        "re",
        "fractions",
        "bisect",
        "heapq",
        "copy",
        "warnings",
        "contextlib",
        "textwrap",
        "keyword",
        "builtins",
    }
)
"""Standard-library modules (by top-level name, a leading ``_`` dropped: ``_operator``) taken as fixed code and
constants. Every other one holds state that can change between calls (``os.environ``, ``time.time()``,
``random.random()``, ``sys.argv``, files): a program reading it, its code or its objects is refused."""
_STATE_ADVICE = (
    "can change between calls (the environment, files, the clock, random numbers, sys.argv), while a "
    "program is traced once and what it reads is baked into its kernel: read it outside the program "
    "and pass the value as an argument"
)
_ROOTS = {
    "LOAD_GLOBAL": "the global",
    "LOAD_NAME": "the global",
    "LOAD_FROM_DICT_OR_GLOBALS": "the global",
    "LOAD_DEREF": "the closure variable",
    "LOAD_CLASSDEREF": "the closure variable",
    "LOAD_FROM_DICT_OR_DEREF": "the closure variable",
}
_ATTRIBUTES = frozenset({"LOAD_ATTR", "LOAD_METHOD"})  # 3.12 folds LOAD_METHOD into LOAD_ATTR; argval: the name
_CODE = (types.FunctionType, types.MethodType, types.ModuleType, type, types.BuiltinFunctionType)


_PLAIN = frozenset({type(None), bool, int, str})
_BY_ITSELF = frozenset({types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type})
"""Types whose objects are equal and hash only to themselves: a key part can hold them as they are."""


def freeze(value: Any, by_identity: tuple[type, ...] = (), on_code: Callable[[Any], None] | None = None) -> Any:
    """A hashable key for a static value that tells its type apart (``True``, ``1`` and ``1.0`` differ, and
    ``-0.0`` and ``0.0``; every NaN is the same): None, bool, int, float, str, and tuples, lists and dicts of
    those; objects of the ``by_identity`` types (code: functions, combinators) stand for themselves, each
    passed to ``on_code``.
    Raises TypeError naming any other type."""
    kind = type(value)
    if kind in _PLAIN:
        return kind, value
    if kind in _BY_ITSELF and isinstance(value, by_identity):
        if on_code is not None:
            on_code(value)
        return kind, value
    if isinstance(value, float):
        return kind, float.__repr__(value)  # exact (repr round-trips), with the sign of a zero; "nan" for any NaN
    if isinstance(value, (int, str, enum.Enum)):  # IntEnum, str subclasses; an Enum member is a singleton
        return kind, value
    if isinstance(value, (tuple, list)):
        return kind, tuple(freeze(v, by_identity, on_code) for v in value)
    if isinstance(value, dict):
        return dict, tuple((freeze(k, by_identity, on_code), freeze(v, by_identity, on_code)) for k, v in value.items())
    if isinstance(value, by_identity):
        if on_code is not None:
            on_code(value)
        return kind, (value if kind in _BY_ITSELF else _Same(value))
    raise TypeError(kind.__name__)


class _Same:
    """A key part equal only to one object, which it keeps alive (so no later object takes its id)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _module_name(value: Any) -> str | None:
    return value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)


def _library(name: str | None) -> bool:
    """Whether the module ``name`` is in ``LIBRARIES`` or the standard library (a module of the user's
    named like one, a ``code.py``, is not)."""
    if not isinstance(name, str):
        return False
    top = name.partition(".")[0]
    module = sys.modules.get(top)
    found = _libraries.get(top)
    if found is None or found[0] is not module:
        file = getattr(module, "__file__", None)
        found = _libraries[top] = (
            module,
            top in LIBRARIES
            or (top in sys.stdlib_module_names and (file is None or os.path.realpath(file).startswith(_STDLIB))),
        )
    return found[1]


def _state_module(name: Any) -> bool:
    """Whether the module named ``name`` is of the standard library and outside ``FIXED_STDLIB``."""
    top = name.partition(".")[0] if isinstance(name, str) else ""
    return top in sys.stdlib_module_names and top.lstrip("_") not in FIXED_STDLIB and _library(name)


def _stdlib_state(value: Any) -> str | None:
    """The standard-library module of changing state that ``value`` is or is code of (a bound method counts by
    its object too: ``os.environ.get``, ``random.random``); None for anything else (other values are frozen)."""
    for holder in (value, getattr(value, "__self__", None)) if isinstance(value, _CODE) else ():
        if _state_module(_module_name(holder)):
            return _module_name(holder)
    return None


def _user(value: Any) -> bool:
    """Code of the user's (a function, method, module or class outside ``LIBRARIES``)."""
    return (
        isinstance(value, _CODE)
        and not isinstance(value, types.BuiltinFunctionType)
        and not _library(_module_name(value))
    )


def _namespace(value: Any) -> bool:
    """A module or class of user code: a read's attribute chain continues through it."""
    return isinstance(value, (types.ModuleType, type)) and not _library(_module_name(value))


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code of the functions, lambdas and comprehensions defined in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _chains(code: types.CodeType) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """(what, name, attributes) for each load of a global or closure variable followed by attribute loads
    (``Cfg.left``: "the global", "Cfg", ("left",)), and ("import", module, ()) for each import."""
    for c in _codes(code):
        chain = None
        for ins in dis.get_instructions(c):
            if chain is not None and ins.opname in _ATTRIBUTES:
                chain[2].append(ins.argval)
                continue
            if chain is not None:
                yield chain[0], chain[1], tuple(chain[2])
                chain = None
            if ins.opname in _ROOTS:
                chain = (_ROOTS[ins.opname], ins.argval, [])
            elif ins.opname == "IMPORT_NAME":
                yield "import", ins.argval, ()
        if chain is not None:
            yield chain[0], chain[1], tuple(chain[2])


class _Stale(Exception):
    """A read resolved to code of the user's that the analysis did not see: analyse again."""


class _Read:
    """One path read at each call: a global (``holder`` a globals dict) or closure cell, then attributes
    followed while the value is a module or class of user code."""

    __slots__ = ("holder", "name", "attributes", "label")

    def __init__(self, holder: Any, name: str, attributes: tuple[str, ...], label: str):
        self.holder, self.name, self.attributes, self.label = holder, name, attributes, label

    def value(self) -> Any:
        holder = self.holder
        value = holder.get(self.name, _EMPTY) if isinstance(holder, dict) else _contents(holder)
        for attribute in self.attributes:
            if not _namespace(value):
                break
            value = getattr(value, attribute, _EMPTY)
        return value


class OutsideReads:
    """The values ``fn`` (and the user code it reaches) reads from outside its arguments, found at
    decoration; ``key()`` freezes them at each call.

    Globals and closure variables bound to modules of ``LIBRARIES`` (``af``, ``torch``, ``math``) and
    builtins are left out, so a program that reads only those adds no work per call (``empty``). Objects of
    the ``ignored`` types (combinators, programs) count by identity.
    """

    def __init__(self, fn: Callable, ignored: tuple[type, ...]):
        # a method's reads through self: not followed
        self._fn = fn.__func__ if isinstance(fn, types.MethodType) else fn
        self._name = getattr(fn, "__qualname__", repr(fn))
        self._identity = _CODE + ignored
        self._analyse()

    def _analyse(self) -> None:
        """Find the reads of ``fn`` and of the user functions they reach (a worklist, each function once)."""
        reads: dict[tuple, _Read] = {}
        self._functions: dict[int, Any] = {}  # by id, kept alive so that no other object takes the id
        todo = [self._fn] if isinstance(self._fn, types.FunctionType) else []  # a callable object: not inspected
        while todo:
            f = todo.pop()
            if id(f) in self._functions:
                continue
            self._functions[id(f)] = f
            where = "" if f is self._fn else f" (in {f.__qualname__})"
            cells = dict(zip(f.__code__.co_freevars, f.__closure__ or ()))
            for what, name, attributes in _chains(f.__code__):
                if what == "import":
                    self._check_import(name, where)
                    continue
                if what == "the closure variable":
                    if name not in cells:
                        continue  # a local variable of f that a function defined in f reads
                    holder = cells[name]
                else:
                    holder = f.__globals__
                    if name not in holder and hasattr(builtins, name):
                        if name in _OPAQUE_BUILTINS:
                            raise ProgramError(
                                f"{self._name}{where} calls {name}(): what it reads cannot be "
                                f"found, so a changed value could not trace again; read "
                                f"globals by name, or pass values as arguments"
                            )
                        if name in _STATE_BUILTINS:
                            raise ProgramError(
                                f"{self._name}{where} calls {name}(): it reads a file or the "
                                f"terminal, which {_STATE_ADVICE}"
                            )
                        continue
                read = self._follow(holder, name, attributes, what, where, todo)
                if read is not None:
                    reads.setdefault((id(holder), name, read.attributes), read)
        self._reads = tuple(reads.values())
        self.empty = not self._reads

    def _check_import(self, module: str, where: str) -> None:
        if _state_module(module):
            raise ProgramError(
                f"{self._name}{where} imports {module!r} inside a function, standard-library state that {_STATE_ADVICE}"
            )
        if not _library(module):
            what = repr(module) if module else "a module of its package (a relative import)"
            raise ProgramError(
                f"{self._name}{where} imports {what} inside a function: what it then reads from "
                f"it cannot be found; import it at module level, or pass the values as arguments"
            )

    def _follow(
        self, holder: Any, name: str, attributes: tuple[str, ...], what: str, where: str, todo: list
    ) -> _Read | None:
        """The read of ``name`` in ``holder`` as tracked, its chain of ``attributes`` cut where it leaves user
        namespaces; None when it reads a library's module. User functions it reaches join ``todo``."""
        read = _Read(holder, name, (), "")
        value = read.value()
        used: list[str] = []
        for attribute in attributes:
            if not _namespace(value):
                break
            used.append(attribute)
            value = getattr(value, attribute, _EMPTY)
        self._refuse_state(value, attributes[len(used) :], f"{what} {'.'.join((name, *attributes))!r}{where}")
        if not used and isinstance(value, types.ModuleType) and not _namespace(value):
            return None  # af, torch, math: fixed code
        read = _Read(holder, name, tuple(used), f"{what} {'.'.join((name, *used))!r}{where}")
        self._reach(value, read, todo)
        return read

    def _refuse_state(self, value: Any, attributes: tuple[str, ...], label: str) -> None:
        """Refuse ``value``, or a module the rest of its chain of ``attributes`` passes through, when it is
        standard-library state (``os``, ``time.time``, ``random.random``, ``sys.argv``). Only the standard
        library's modules are walked: another module's attribute may be lazy (``af.softmax`` loads plugins)."""
        for attribute in (None, *attributes):
            if attribute is not None:
                if not (
                    isinstance(value, types.ModuleType) and value.__name__.partition(".")[0] in sys.stdlib_module_names
                ):
                    return
                value = getattr(value, attribute, _EMPTY)
            module = _stdlib_state(value)
            if module is not None:
                raise ProgramError(
                    f"{self._name} reads {label}, standard-library state of {module} that {_STATE_ADVICE}"
                )

    def _reach(self, value: Any, read: _Read, todo: list) -> None:
        """Queue the user functions ``value`` holds; refuse user code whose reads cannot be followed."""
        if isinstance(value, (tuple, list)):
            for v in value:
                self._reach(v, read, todo)
        elif isinstance(value, dict):
            for item in value.items():
                self._reach(item, read, todo)
        elif _user(value):
            if isinstance(value, types.FunctionType):
                todo.append(value)
            elif isinstance(value, type) and issubclass(value, BaseException):
                self._functions[id(value)] = value  # raised, not read from
            else:
                what = (
                    "a bound method"
                    if isinstance(value, types.MethodType)
                    else f"the {'module' if isinstance(value, types.ModuleType) else 'class'} itself"
                )
                raise ProgramError(
                    f"{self._name} reads {read.label}, {what}: AttnFuse follows reads of a module's or class's "
                    f"attributes by name (Cfg.left) and calls of plain functions, but not what is read through "
                    f"a module, class or instance passed around as a value; read its attributes by name, or "
                    f"pass the values as arguments"
                )

    def key(self) -> tuple:
        """The frozen values read now, in a fixed order; () when the function reads none."""
        if self.empty:
            return ()
        try:
            return self._key()
        except _Stale:
            self._analyse()  # it queues every user function the reads hold and refuses other user code
            return self._key()

    def _key(self) -> tuple:
        key = []
        for read in self._reads:
            value = read.value()
            if value is _EMPTY:
                key.append(None)  # unassigned: the function itself raises NameError or AttributeError
                continue
            try:
                key.append(freeze(value, self._identity, self._check_code))
            except TypeError as exc:
                raise ProgramError(
                    f"{self._name} reads {read.label}, which holds a {exc}: a program is traced once and what it "
                    f"reads from outside its arguments is baked into the kernel, so such a value must be None, "
                    f"bool, int, float, str, or a tuple, list or dict of those; pass "
                    f"{'.'.join((read.name, *read.attributes))!r} as an argument of the program instead"
                ) from None
        return tuple(key)

    def _check_code(self, value: Any) -> None:
        if id(value) not in self._functions and (_user(value) or _stdlib_state(value) is not None):
            raise _Stale


class _Empty:
    """An unassigned closure cell, undefined global or missing attribute (the function raises if it reads one)."""


_EMPTY: Any = _Empty()


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY
