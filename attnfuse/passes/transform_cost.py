"""What a program's qk transforms cost, fused or hoisted: the inputs of the rule that chooses between them
(docs/architecture.md, "Fused or hoisted: the rule").

Counted from the transforms' own fragment text, so a third party's transform is counted like a built-in:
every arithmetic operation outside a ``tl.load`` (``+ - * /``, unary minus, and a ``tl`` math call such as
``tl.sqrt`` or ``tl.sum``) is one FLOP for each of the D/2 elements of a half row; a ``tl.load`` whose text
reads the rows' positions (``$pos``) reads D/2 table elements a row, one that does not (a weight, the same
for every row) is read once a tile and counted as nothing a row. The counts are upper bounds: an operation
on a row's scalar (an RMS norm's mean) counts as D/2 of them.

Fused, the forward transforms each q row once, and each k row once for every query block that visits it.
Hoisted, one pass transforms every q and k row once, reading and writing each (``pass_bytes``), and the
forward reads the transformed rows where the fused one reads the raw ones.
"""

from __future__ import annotations

import ast

import torch
from attrs import frozen

from ..parsing import parse
from .codegen.common import half_columns
from .lower import LoweredProgram

_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_TABLE_BYTES = 4  # the tables rope prepares are float32 (float64 for float64 inputs, counted as such)


@frozen(kw_only=True)
class SideCost:
    """One side's transforms (q's or k's), per row: ``flops`` of arithmetic, ``table_bytes`` of the tables
    indexed by the row's position."""

    flops: int
    table_bytes: int


@frozen(kw_only=True)
class TransformCost:
    """The per-row costs of a program's qk transforms, by side, and ``pass_bytes``: what the hoisted pass
    reads and writes a row (the row in, the transformed row out, in the inputs' dtype)."""

    q: SideCost
    k: SideCost
    pass_bytes: int

    def fields(self) -> dict:
        """The JSON object ``attnfuse show --json`` prints."""
        return {
            "q_row": {"flops": self.q.flops, "table_bytes": self.q.table_bytes},
            "k_row": {"flops": self.k.flops, "table_bytes": self.k.table_bytes},
            "pass_bytes_per_row": self.pass_bytes,
        }


def transform_cost(kernel: LoweredProgram) -> TransformCost | None:
    """The per-row costs of ``kernel``'s qk transforms, or None for a program with none."""
    if not kernel.transforms:
        return None
    half = kernel.config.head_dim // 2
    table = 8 if kernel.config.dtype == "float64" else _TABLE_BYTES
    element = getattr(torch, kernel.config.dtype).itemsize
    sides = {}
    for side in ("q", "k"):
        flops = loads = 0
        for t in kernel.transforms:
            text = getattr(t.fragment, side)
            if text:
                site = dict(x1="x1", x2="x2", pos="pos", ok="ok", tmp="tmp", **half_columns(kernel))
                counted = _count(t.code(text, **site))
                flops, loads = flops + counted[0], loads + counted[1]
        sides[side] = SideCost(flops=flops * half, table_bytes=loads * half * table)
    return TransformCost(q=sides["q"], k=sides["k"], pass_bytes=2 * kernel.config.head_dim * element)


def _count(code: str) -> tuple[int, int]:
    """(arithmetic operations outside loads, loads that read the rows' positions) in fragment ``code``."""
    operations = row_loads = 0
    stack = [parse(code)]
    while stack:
        node = stack.pop()
        if _is_tl_call(node, "load"):
            row_loads += any(isinstance(n, ast.Name) and n.id == "pos" for n in ast.walk(node))
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, _ARITHMETIC):
            operations += 1
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            operations += 1
        elif isinstance(node, ast.Call) and _is_tl_call(node):
            operations += 1
        stack.extend(ast.iter_child_nodes(node))
    return operations, row_loads


def _is_tl_call(node: ast.AST, name: str | None = None) -> bool:
    """Whether ``node`` calls ``tl.<name>`` (when None, any ``tl`` function but the tile builders)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    func = node.func
    if not (isinstance(func.value, ast.Name) and func.value.id == "tl"):
        return False
    return func.attr == name if name is not None else func.attr not in ("full", "zeros", "arange")
