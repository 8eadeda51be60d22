"""Launch specs: a kernel's parameters, in order, described once; every launch binds its arguments by name.

For a generated kernel the same description writes the ``def`` line (``render_signature``) and binds a launch's
arguments (``LaunchSpec.bind``), so the source and the launch cannot disagree on the order of two arguments; a
hand-written kernel's spec is checked against its function's parameters by the tests. A stride parameter names the
tensor parameter it belongs to: a launch gives the tensor, and binding takes the strides from it, so no stride can be
paired with the wrong tensor. Binding checks that the names given are exactly the kernel's.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

from attrs import frozen

TENSOR, STRIDE, INT, SCALAR, CONSTEXPR = "tensor", "stride", "int", "scalar", "constexpr"
TILE_CONSTEXPRS = ("BLOCK_M", "BLOCK_N")  # set by each launch from its tiles


@frozen
class Param:
    """One kernel parameter: its name and kind (tensor, stride, int, a plugin's scalar, or constexpr);
    a stride's ``of``: the tensor parameter whose strides it is one of (all of them, in dimension order)."""

    name: str
    kind: str
    of: str | None = None


def params(kind: str, *names: str) -> tuple[Param, ...]:
    return tuple(Param(n, kind) for n in names)


def strides(prefix: str, dims: str, of: str) -> tuple[Param, ...]:
    """``stride_<prefix><dim>`` for each dim letter: the strides of the 4-D tensor parameter ``of``."""
    return tuple(Param(f"stride_{prefix}{d}", STRIDE, of) for d in dims)


@functools.lru_cache(maxsize=None)
def indexed_stride_names(tensor: str, rank: int) -> tuple[str, ...]:
    """``<tensor>_s<i>``: the strides of a plugin's tensor or a gradient buffer, by dimension."""
    return tuple(f"{tensor}_s{i}" for i in range(rank))


def indexed_strides(tensor: str, rank: int) -> tuple[Param, ...]:
    return tuple(Param(n, STRIDE, tensor) for n in indexed_stride_names(tensor, rank))


def render_signature(name: str, parameters: tuple[Param, ...]) -> str:
    """The kernel's ``def`` line(s): runtime parameters, then ``NAME: tl.constexpr`` ones, wrapped."""
    lines: list[str] = []
    line = ""
    for p in parameters:
        item = f"{p.name}: tl.constexpr," if p.kind == CONSTEXPR else f"{p.name},"
        starts_constexprs = p.kind == CONSTEXPR and not line.endswith("tl.constexpr,") and line
        if line and (len(line) + len(item) > 100 or starts_constexprs):
            lines.append(line)
            line = ""
        line = f"{line} {item}" if line else f"    {item}"
    lines.append(line)
    return f"def {name}(\n" + "\n".join(lines) + "\n):\n"


class LaunchSpec:
    """The ordered parameters of one kernel, and ``constants``: the values of the constexprs fixed when it
    was planned. The other constexprs are ``tiles`` (a generated kernel's BLOCK_M and BLOCK_N, from the
    launch's tiles) and those each launch gives (``launch_constexprs``: a generated kernel's EVEN_K, EVEN_M,
    HAS_DLSE; every constexpr of a hand-written kernel, which takes no ``tiles``)."""

    def __init__(
        self,
        kernel: str,
        parameters: tuple[Param, ...],
        constants: dict[str, Any] | None = None,
        tiles: tuple[str, ...] = TILE_CONSTEXPRS,
    ):
        self.kernel = kernel
        self.params = parameters
        self.constants = dict(constants or {})
        kinds = [p.kind == CONSTEXPR for p in parameters]
        if any(kinds[i] and not kinds[i + 1] for i in range(len(kinds) - 1)):
            raise ValueError(f"{kernel}: constexpr parameters must come after every runtime parameter")
        runtime = [p for p in parameters if p.kind != CONSTEXPR]
        self.runtime_names = tuple(p.name for p in runtime)
        self.stride_names = tuple(p.name for p in runtime if p.kind == STRIDE)
        given = [p.name for p in runtime if p.kind != STRIDE]
        owners = list(dict.fromkeys(p.of for p in runtime if p.kind == STRIDE))
        if not set(owners) <= set(given):
            raise ValueError(f"{kernel}: strides of {sorted(set(owners) - set(given))}, which are not parameters")
        # binding concatenates the given values (in parameter order) and each owner's strides, then reorders
        flat = given + [p.name for owner in owners for p in runtime if p.of == owner]
        position = {name: i for i, name in enumerate(flat)}
        self._given = frozenset(given)
        self._get_given = _getter(given)
        self._get_owners = _getter(owners)
        self._count = len(flat)
        self._order = _getter([position[n] for n in self.runtime_names])
        constexprs = {p.name for p in parameters if p.kind == CONSTEXPR}
        unknown = set(self.constants) - constexprs
        if unknown:
            raise ValueError(f"{kernel}: constants {sorted(unknown)} are not constexpr parameters of the kernel")
        self.launch_constexprs = frozenset(constexprs - set(self.constants) - set(tiles))

    def bind(self, args: dict[str, Any]) -> tuple:
        """The runtime arguments in the kernel's order, from ``args``: every tensor, int and scalar parameter
        by name (a stride parameter comes from its tensor's strides)."""
        try:
            flat = self._get_given(args)
            for tensor in self._get_owners(args):
                flat += tensor.stride()
        except KeyError:
            _mismatch(self.kernel, "argument", args.keys(), self._given)
        if len(args) != len(self._given):
            _mismatch(self.kernel, "argument", args.keys(), self._given)
        if len(flat) != self._count:
            raise TypeError(f"{self.kernel}: a tensor argument has the wrong number of dimensions for its strides")
        return self._order(flat)

    def constexprs(self, given: dict[str, Any]) -> dict[str, Any]:
        """Every constexpr but the tile sizes: the constants, and ``given`` (exactly the launch's own)."""
        if given.keys() != self.launch_constexprs:
            _mismatch(self.kernel, "constexpr", given.keys(), self.launch_constexprs)
        return {**self.constants, **given}


def _getter(keys: list) -> Callable[[Any], tuple]:
    """``itemgetter`` that always returns a tuple."""
    if len(keys) == 1:
        get = operator.itemgetter(keys[0])
        return lambda x: (get(x),)
    return operator.itemgetter(*keys) if keys else (lambda x: ())


def _mismatch(kernel: str, what: str, given, expected: frozenset) -> None:
    missing, unknown = sorted(expected - set(given)), sorted(set(given) - expected)
    raise TypeError(
        f"{kernel}: launch {what}s do not match the kernel's parameters: missing {missing}, unknown {unknown}"
    )
