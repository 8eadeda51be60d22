"""An instance's source reduced to its code, for the digest that names it (``instance.instance_digest``).

Two programs often get the same kernel under different names: an explicit ``scale=1/√D`` (HF passes one)
or ``scale=None``, RoPE from theta or from tables once a pass has applied it, a norm before it. Their
instances differ only in the program's name and IR in the docstring, the names of functions, parameters and
variables, and parameters that nothing reads (a hoisted transform's tables, passed along unread). The
canonical form keeps the code and drops the rest:

- docstrings (and comments, which parsing drops);
- parameters that no function reads, except by passing them on to a parameter no function reads, with the
  arguments that fill them (direct calls and ``(function, (arguments...))`` pairs, as ``warp_specialize``
  takes them);
- names: every function, parameter and variable the module binds is renamed ``_0``, ``_1``, ... in order of
  first appearance. Imported names, builtins and attributes (``gl.load``) keep theirs.

Literals, operations, calls and control flow are untouched, so two instances with the same canonical form
compile to the same kernel.
"""

from __future__ import annotations

import ast
import builtins
import functools

from ..parsing import parse


@functools.lru_cache(maxsize=256)
def canonical_source(source: str) -> str:
    """``source`` (a template instance's module) in canonical form."""
    tree = parse(source)
    functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    _drop_docstrings(tree)
    _drop_unread_parameters(functions)
    _rename(tree)
    return ast.unparse(tree)


def _drop_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                node.body = node.body[1:] or [ast.Pass()]


def _passes(node: ast.AST, functions: dict[str, ast.FunctionDef]) -> list[tuple[str, list[ast.expr]]]:
    """The (local function, positional arguments) pairs ``node`` hands arguments to: a call ``f(...)`` or a
    pair ``(f, (...))``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
        return [(node.func.id, node.args)]
    if (
        isinstance(node, ast.Tuple)
        and len(node.elts) == 2
        and isinstance(node.elts[0], ast.Name)
        and node.elts[0].id in functions
        and isinstance(node.elts[1], ast.Tuple)
    ):
        return [(node.elts[0].id, node.elts[1].elts)]
    return []


def _parameters(function: ast.FunctionDef) -> list[str]:
    return [a.arg for a in function.args.args]


def _drop_unread_parameters(functions: dict[str, ast.FunctionDef]) -> None:
    """Remove every parameter nothing reads (a fixed point: a parameter passed on only to unread ones is unread
    too), and the positional arguments that fill the removed ones."""
    read: dict[str, set[str]] = {
        name: set(_parameters(f)) if f.args.defaults or f.args.kw_defaults else set()  # defaults: all kept
        for name, f in functions.items()
    }
    changed = True
    while changed:
        changed = False
        for name, function in functions.items():
            params = set(_parameters(function))
            forwarded: set[int] = set()  # ids of Name nodes handed on to an unread parameter
            for node in ast.walk(function):
                for callee, args in _passes(node, functions):
                    targets = _parameters(functions[callee])
                    for arg, target in zip(args, targets):
                        if isinstance(arg, ast.Name) and target not in read[callee]:
                            forwarded.add(id(arg))
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Name)
                    and node.id in params
                    and node.id not in read[name]
                    and id(node) not in forwarded
                    and not isinstance(node.ctx, ast.Store)
                ):
                    read[name].add(node.id)
                    changed = True
    for name, function in functions.items():
        for node in ast.walk(function):
            for callee, args in _passes(node, functions):
                targets = _parameters(functions[callee])
                args[:] = [a for a, t in zip(args, targets) if t in read[callee]] + args[len(targets) :]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
                callee = node.func.id
                node.keywords = [
                    k for k in node.keywords if k.arg not in _parameters(functions[callee]) or k.arg in read[callee]
                ]
    for name, function in functions.items():
        function.args.args = [a for a in function.args.args if a.arg in read[name]]


def _rename(tree: ast.Module) -> None:
    """Rename what the module binds (functions, parameters, variables) in order of first appearance."""
    imported = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        names = [node.name, *(a.arg for a in node.args.args)] if isinstance(node, ast.FunctionDef) else []
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names = [node.id]
        for name in names:
            if name not in bound and name not in imported and not hasattr(builtins, name):
                bound[name] = f"_{len(bound)}"
    local = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in local
    ]
    for call in calls:  # keywords name the callee's parameters: renamed with them (others' keep theirs)
        for keyword in call.keywords:
            keyword.arg = bound.get(keyword.arg, keyword.arg)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            node.name = bound.get(node.name, node.name)
            for a in node.args.args:
                a.arg = bound.get(a.arg, a.arg)
        elif isinstance(node, ast.Name):
            node.id = bound.get(node.id, node.id)
