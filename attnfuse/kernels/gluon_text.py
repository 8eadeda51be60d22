"""Fragment text, as plugins write it for the generated Triton kernels, made valid inside a Gluon template.

A fragment calls ``tl.*`` functions. Inside a Gluon kernel these work unchanged on the template's tensors
(Gluon computes elementwise ops, reductions, loads and casts through the same builtins), except those that
create a tensor from nothing: Gluon needs their register layout. ``for_template`` rewrites those calls
(``tl.full``, ``tl.zeros``, ``tl.arange``) into Gluon's, with the layout their shape has in the template's
score tile (``S_LAYOUT``): a shape ``[BLOCK_M]`` or a range to ``BLOCK_M`` is a column of rows
(``ROW_LAYOUT``), ``[BLOCK_N]`` a row of keys (``KEY_LAYOUT``), ``[BLOCK_M, BLOCK_N]``, ``[BLOCK_M, 1]`` and
``[1, BLOCK_N]`` the tile's own. Nothing else in the text changes, so one fragment runs under the
interpreter, in the generated kernels and in the template. A shape of any other kind is left as written,
and the template's compile error names the fragment.
"""

from __future__ import annotations

import ast
import functools
import textwrap

from ..parsing import parse as _parse

CONSTRUCTORS = ("full", "zeros", "arange")
LAYOUTS = {"BLOCK_M": "ROW_LAYOUT", "BLOCK_N": "KEY_LAYOUT"}  # a 1-d extent -> the template's layout name
TILE_LAYOUT = "S_LAYOUT"


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _layout(node: ast.Call, kind: str) -> str | None:
    """The layout name of a ``tl.<kind>(...)`` call's result, or None when its shape is not a tile's."""
    if kind == "arange":
        return LAYOUTS.get(_name(node.args[1])) if len(node.args) == 2 else None
    shape = node.args[0] if node.args else None
    if not isinstance(shape, (ast.List, ast.Tuple)):
        return None
    dims = [_name(d) or (d.value if isinstance(d, ast.Constant) else None) for d in shape.elts]
    if len(dims) == 1:
        return LAYOUTS.get(dims[0])
    if len(dims) == 2 and dims in (["BLOCK_M", "BLOCK_N"], ["BLOCK_M", 1], [1, "BLOCK_N"]):
        return TILE_LAYOUT
    return None


class _Rewrite(ast.NodeTransformer):
    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and _name(f.value) == "tl" and f.attr in CONSTRUCTORS:
            layout = _layout(node, f.attr)
            if layout is not None:
                node.func = ast.Attribute(ast.Name("gl", ast.Load()), f.attr, ast.Load())
                node.keywords.append(ast.keyword("layout", ast.Name(layout, ast.Load())))
        return node


@functools.lru_cache(maxsize=4096)
def for_template(text: str) -> str:
    """``text`` (fragment statements or an expression, any indentation) with its layout-less constructors
    made Gluon's; dedented, and unchanged when it has none."""
    code = textwrap.dedent(text).strip()
    if not any(f"tl.{name}(" in code for name in CONSTRUCTORS):
        return code
    return ast.unparse(_Rewrite().visit(_parse(code)))


def assigned(text: str) -> list[str]:
    """The names ``text``'s top-level statements assign, in order (a normaliser's state, from its init)."""
    code = textwrap.dedent(text).strip()
    names: list[str] = []
    for stmt in _parse(code).body if code else []:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        for t in targets:
            for n in ast.walk(t) if t is not None else ():
                if isinstance(n, ast.Name) and n.id not in names:
                    names.append(n.id)
    return names


def _row_factor(stmt: ast.stmt) -> ast.expr | None:
    """X of ``acc = acc * X[:, None]``, or None when ``stmt`` is not of that form."""
    if not (isinstance(stmt, ast.Assign) and [_name(t) for t in stmt.targets] == ["acc"]):
        return None
    v = stmt.value
    if not (isinstance(v, ast.BinOp) and isinstance(v.op, ast.Mult) and _name(v.left) == "acc"):
        return None
    r = v.right
    index = r.slice if isinstance(r, ast.Subscript) else None
    if not (isinstance(index, ast.Tuple) and len(index.elts) == 2):
        return None
    whole, new_axis = index.elts
    if not (isinstance(whole, ast.Slice) and whole.lower is whole.upper is whole.step is None):
        return None
    return r.value if isinstance(new_axis, ast.Constant) and new_axis.value is None else None


def row_rescale(text: str, rows: str) -> str | None:
    """A normaliser's update with each ``acc = acc * X[:, None]`` made ``<rows> = <rows> * (X)``: the
    template multiplies its accumulator by ``rows`` once the block before has been added to it. None when
    the update reads or writes ``acc`` in any other way (the template cannot run it)."""
    tree = _parse(textwrap.dedent(text).strip())
    for i, stmt in enumerate(tree.body):
        factor = _row_factor(stmt)
        if factor is not None:
            tree.body[i] = _parse(f"{rows} = {rows} * ({ast.unparse(factor)})").body[0]
        elif any(_name(n) == "acc" for n in ast.walk(stmt)):
            return None
    return ast.unparse(tree)
