"""Static parameter values: the only forms in which they reach generated source.

A combinator's static parameters are written into its kernels as literals (``$param`` in fragment text)
and into the program listing in each generated file's header. ``literal`` is the one function that
writes them, and it writes only text that cannot be code: None, True, False, an int of int64, a float of
float32's normal range or 0 (its shortest round-tripping repr; Triton types other float literals as
float64, which would change the kernel's arithmetic), or a short identifier-like string in quotes. The
DSL checks every static value with it when it builds an application, so a value it refuses never
reaches a source.
"""

from __future__ import annotations

import re
from typing import Any

STATIC_TYPES = (type(None), bool, int, float, str)
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # the kernels' widest integer type, int64
FLOAT_MIN, FLOAT_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127  # float32's normal range: a float32 literal
TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
"""A string a static value may hold: an ASCII identifier-like token of at most 64 characters ("neox")."""

ALLOWED = (
    "None, a bool, an int in [-2**63, 2**63 - 1], a float that is 0 or of magnitude in float32's normal "
    "range, or a str of at most 64 ASCII letters, digits and '_' not starting with a digit"
)


def literal(value: Any) -> str:
    """The source text of a static value (``ALLOWED``); raises ValueError saying what was given and what
    is allowed. Subclasses of int, float and str are refused (``exact`` converts them): their ``repr`` is
    theirs to choose."""
    kind = type(value)
    if value is None or kind is bool:
        return repr(value)
    if kind is int:
        if INT_MIN <= value <= INT_MAX:
            return int.__repr__(value)
        raise ValueError(
            f"an int must lie in [-2**63, 2**63 - 1] (int64, the kernels' widest integer type), got {shown(value)}"
        )
    if kind is float:
        if value == 0.0 or FLOAT_MIN <= abs(value) <= FLOAT_MAX:
            return float.__repr__(value)
        raise ValueError(
            f"a float must be 0 or of magnitude in [2**-126, {FLOAT_MAX!r}], float32's normal range "
            f"(Triton types any other float literal as float64), got {value!r}"
        )
    if kind is str:
        if TOKEN.fullmatch(value):
            return str.__repr__(value)
        given = str.__repr__(value[:40]) + ("..." if len(value) > 40 else "")
        raise ValueError(
            f"a str must be an identifier-like token of at most 64 ASCII letters, digits and '_', "
            f"not starting with a digit (such as 'neox'), got {given}"
        )
    raise ValueError(f"must be {ALLOWED}; got a {kind.__module__}.{kind.__qualname__}")


def typed(value: Any) -> tuple[type, str]:
    """A static value as a key that tells apart values Python calls equal but a kernel does not: ``True``,
    ``1`` and ``1.0``; ``0``, ``False``, ``0.0`` and ``-0.0`` (its type and its ``literal``)."""
    return type(value), literal(value)


def exact(value: Any) -> Any:
    """A subclass of int, float or str (an IntEnum member, a numpy.float64) as the plain int, float or str
    it holds (read by the base type's own method), so nothing the subclass overrides, its ``repr`` above
    all, reaches a source; any other value as it is."""
    if type(value) in STATIC_TYPES:
        return value
    for base, plain in ((int, int.__int__), (float, float.__float__), (str, str.__str__)):
        if isinstance(value, base):
            return plain(value)
    return value


def shown(value: Any) -> str:
    """``repr(value)`` for a message, but an int past 128 bits as its size (10**5000 has no repr)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"
    return repr(value)
