"""``CallSpec``: what is static about a program call, and its string form, the key of the op's calls.

The key is the spec's canonical ``repr``. A compiled graph loaded from a cache in a fresh process carries keys
this process never built, so a key not registered here is parsed back (a restricted evaluator over the IR's
constructors; nothing else is evaluated).
"""
from __future__ import annotations

import ast
from typing import Any

import torch
from attrs import frozen

from .. import ir
from ..block_mask import BlockMask
from ..block_mask_checks import TENSORS as MASK_TENSORS
from ..errors import InputError, PluginError
from ..lru import LRUCache
from ..plugin_manager import registered


@frozen(kw_only=True, cache_hash=True)
class CallSpec:
    """What is static about one kind of program call.

    ``inputs``: (argument name, None for a tensor or (Nq, Nk, block_size, kv_heavy_blocks) for a BlockMask)
    in the order of the op's input list. ``save_lse``: the op returns lse (B, Hq, Nq), else an empty (0,)
    tensor. ``grad``: the call is differentiable (no split-KV path). ``grads``: the inputs whose gradient the
    backward returns."""

    graph: ir.MatMulPV
    inputs: tuple
    save_lse: bool
    grad: bool
    grads: tuple


MAX_SPECS = 1024  # call specs kept (a program's few per configuration); one dropped is parsed back if needed
_specs: LRUCache[str, CallSpec] = LRUCache(MAX_SPECS)
_keys: LRUCache[tuple, str] = LRUCache(MAX_SPECS)  # by the spec's fields: a warm call builds no CallSpec


def key_of(graph: ir.MatMulPV, inputs: tuple, save_lse: bool, grad: bool, grads: tuple) -> str:
    """The op's string argument for the spec of these fields (registered, so the op finds it unparsed)."""
    fields = (graph, inputs, save_lse, grad, grads)
    key = _keys.get(fields)
    if key is None:
        key = _keys.get_or_build(fields, lambda: _register(CallSpec(graph=graph, inputs=inputs, save_lse=save_lse,
                                                                    grad=grad, grads=grads)))
    return key


def _register(spec: CallSpec) -> str:
    """Keep ``spec`` under its key (its repr); the key."""
    key = repr(spec)
    _specs.get_or_build(key, lambda: spec)
    return key


def call_key(spec: CallSpec) -> str:
    """The op's string argument for ``spec``."""
    return key_of(spec.graph, spec.inputs, spec.save_lse, spec.grad, spec.grads)


def spec_of(key: str) -> CallSpec:
    return _specs.get_or_build(key, lambda: _parse(key))


def _apply(**fields: Any) -> ir.Apply:
    """An application parsed from a key: its combinator resolved by name, as tracing resolves it."""
    return ir.Apply(**fields, record=registered(fields.get("combinator")))


_CONSTRUCTORS = {c.__name__: c for c in (CallSpec, ir.MatMulPV, ir.NormOp, ir.MaskOp, ir.BiasOp, ir.ScoreOp,
                                         ir.TensorSym)} | {"Apply": _apply}


def _parse(key: str) -> CallSpec:
    """A ``CallSpec`` from its repr: constants, tuples, -x, inf, nan and calls of the IR's constructors with
    keyword arguments; anything else is an InputError."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Tuple):
            return tuple(value(e) for e in node.elts)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Name) and node.id in ("inf", "nan"):
            return float(node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CONSTRUCTORS \
                and not node.args:
            return _CONSTRUCTORS[node.func.id](**{kw.arg: value(kw.value) for kw in node.keywords})
        raise ValueError(ast.dump(node)[:80])
    try:
        spec = value(ast.parse(key, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, PluginError):
        spec = None
    if not isinstance(spec, CallSpec):
        raise InputError(f"attnfuse::attention: key must be the repr of a CallSpec (constants and the IR's "
                         f"constructors called with keywords), got {key[:80]!r}")
    return spec


def flatten_inputs(inputs: dict[str, Any]) -> tuple[tuple, list[torch.Tensor]]:
    """The spec's input layout and the op's tensor list for runtime inputs by name."""
    layout, tensors = [], []
    for name, value in inputs.items():
        if isinstance(value, BlockMask):
            value.check_unchanged()
            layout.append((name, (value.Nq, value.Nk, value.block_size, value.kv_heavy_blocks)))
            tensors += value.tensors()
        else:
            layout.append((name, None))
            tensors.append(value)
    return tuple(layout), tensors


def unflatten_inputs(spec: CallSpec, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The runtime inputs by name from the op's tensor list (block masks rebuilt, refused if edited)."""
    inputs, i = {}, 0
    for name, mask in spec.inputs:
        if mask is None:
            inputs[name], i = tensors[i], i + 1
        else:
            inputs[name] = BlockMask.rebuilt(mask, tensors[i:i + len(MASK_TENSORS)])
            i += len(MASK_TENSORS)
    return inputs



def plain_tensors(spec: CallSpec, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensor inputs by name from the op's tensor list (block masks' tensors left out)."""
    found, i = {}, 0
    for name, mask in spec.inputs:
        if mask is None:
            found[name] = tensors[i]
        i += 1 if mask is None else len(MASK_TENSORS)
    return found


def tensor_names(spec: CallSpec) -> list[str]:
    """The argument name of each tensor of the op's list (a block mask's name for each of its tensors)."""
    return [name for name, mask in spec.inputs for _ in range(1 if mask is None else len(MASK_TENSORS))]
