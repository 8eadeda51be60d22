"""Launch specs: a generated kernel's parameters, in order, described once.

The same description writes the kernel's ``def`` line (``render_signature``) and binds a launch's
arguments by name (``LaunchSpec.bind``), so the source and the launch cannot disagree on the order of two
strides. Binding checks that the names given are exactly the kernel's.
"""
from __future__ import annotations

import operator
from typing import Any

from attrs import frozen

TENSOR, STRIDE, INT, SCALAR, CONSTEXPR = "tensor", "stride", "int", "scalar", "constexpr"
TILE_CONSTEXPRS = ("BLOCK_M", "BLOCK_N")  # set by each launch from its tiles


@frozen
class Param:
    """One kernel parameter: its name and kind (tensor, stride, int, a plugin's scalar, or constexpr)."""

    name: str
    kind: str


def params(kind: str, *names: str) -> tuple[Param, ...]:
    return tuple(Param(n, kind) for n in names)


def stride_names(prefix: str, dims: str = "bhnd") -> tuple[str, ...]:
    """``stride_<prefix><dim>`` for each dim letter: the strides of a 4-D tensor argument."""
    return tuple(f"stride_{prefix}{d}" for d in dims)


def strides(prefix: str, dims: str = "bhnd") -> tuple[Param, ...]:
    return params(STRIDE, *stride_names(prefix, dims))


def named_strides(prefix: str, tensor: Any, dims: str = "bhnd") -> dict[str, int]:
    """A tensor's strides by parameter name (see ``stride_names``)."""
    return dict(zip(stride_names(prefix, dims), tensor.stride()))


def indexed_stride_names(tensor: str, rank: int) -> tuple[str, ...]:
    """``<tensor>_s<i>``: the strides of a plugin's tensor or a gradient buffer, by dimension."""
    return tuple(f"{tensor}_s{i}" for i in range(rank))


def indexed_strides(tensor: str, value: Any) -> dict[str, int]:
    return dict(zip(indexed_stride_names(tensor, value.dim()), value.stride()))


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
    was planned. The other constexprs are BLOCK_M and BLOCK_N (from the launch's tiles) and those each
    launch gives (``launch_constexprs``: EVEN_K, EVEN_M, HAS_DLSE)."""

    def __init__(self, kernel: str, parameters: tuple[Param, ...], constants: dict[str, Any]):
        self.kernel = kernel
        self.params = parameters
        self.constants = dict(constants)
        kinds = [p.kind == CONSTEXPR for p in parameters]
        if any(kinds[i] and not kinds[i + 1] for i in range(len(kinds) - 1)):
            raise ValueError(f"{kernel}: constexpr parameters must come after every runtime parameter")
        self.runtime_names = tuple(p.name for p in parameters if p.kind != CONSTEXPR)
        self.stride_names = tuple(p.name for p in parameters if p.kind == STRIDE)
        constexprs = {p.name for p in parameters if p.kind == CONSTEXPR}
        unknown = set(constants) - constexprs
        if unknown:
            raise ValueError(f"{kernel}: constants {sorted(unknown)} are not constexpr parameters of the kernel")
        self.launch_constexprs = frozenset(constexprs - set(constants) - set(TILE_CONSTEXPRS))
        self._runtime_set = frozenset(self.runtime_names)
        self._get = operator.itemgetter(*self.runtime_names)

    def bind(self, **args: Any) -> tuple:
        """The runtime arguments in the kernel's order, from arguments by parameter name."""
        if args.keys() != self._runtime_set:
            _mismatch(self.kernel, "argument", args.keys(), self._runtime_set)
        return self._get(args)

    def constexprs(self, given: dict[str, Any]) -> dict[str, Any]:
        """Every constexpr but the tile sizes: the constants, and ``given`` (exactly the launch's own)."""
        if given.keys() != self.launch_constexprs:
            _mismatch(self.kernel, "constexpr", given.keys(), self.launch_constexprs)
        return {**self.constants, **given}


def _mismatch(kernel: str, what: str, given, expected: frozenset) -> None:
    missing, unknown = sorted(expected - set(given)), sorted(set(given) - expected)
    raise TypeError(f"{kernel}: launch {what}s do not match the kernel's parameters: missing {missing}, "
                    f"unknown {unknown}")
