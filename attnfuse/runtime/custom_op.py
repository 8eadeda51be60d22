"""The op boundary: every program call is ``torch.ops.attnfuse.attention``, opaque to ``torch.compile``.

A call is described by a ``CallSpec`` (the traced graph, the layout of the runtime inputs, whether the
log-sum-exp is saved, which inputs want gradients), passed to the op as a string: its canonical ``repr``.
The string names everything static about the call, so Dynamo guards on nothing of AttnFuse's and never
traces its Python, and a compiled graph loaded from a cache in a fresh process still runs: a key this
process has not seen is parsed back (``_parse``, a restricted evaluator over the IR's constructors).

Tensor arguments: q, k, v, kv_lens?, block_table?, and the runtime inputs as one list, a ``BlockMask``
flattened into its tensors (its sizes live in the spec). The backward is a second op,
``attnfuse::attention_backward``, registered as the first one's autograd formula, so it runs under
compile too. The op bodies call the same planned kernels as ``run_attention``.
"""
from __future__ import annotations

import ast
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from attrs import frozen

from .. import ir
from ..block_mask import BlockMask
from ..errors import InputError
from ..passes.lower import fragment_of
from .hoisted import HoistedForward
from .inputs import empty_like_layout, kv_cache, accumulator_dtype
from .launch import _plan, compile_backward, compile_hoisted_backward, run_attention

_MASK_TENSORS = ("active", "kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices", "q_block_order",
                 "kv_block_order")


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


_specs: dict[str, CallSpec] = {}
_keys: dict[CallSpec, str] = {}


def call_key(spec: CallSpec) -> str:
    """The op's string argument for ``spec`` (registered, so the op finds it without parsing)."""
    key = _keys.get(spec)
    if key is None:
        key = _keys[spec] = repr(spec)
        _specs[key] = spec
    return key


def spec_of(key: str) -> CallSpec:
    spec = _specs.get(key)
    if spec is None:
        spec = _specs[key] = _parse(key)
    return spec


_CONSTRUCTORS = {c.__name__: c for c in (CallSpec, ir.MatMulPV, ir.NormOp, ir.MaskOp, ir.BiasOp, ir.ScoreOp,
                                         ir.Apply, ir.TensorSym)}


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
    except (SyntaxError, ValueError, TypeError):
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
            tensors += [getattr(value, t) for t in _MASK_TENSORS]
        else:
            layout.append((name, None))
            tensors.append(value)
    return tuple(layout), tensors


def _unflatten(spec: CallSpec, tensors: list[torch.Tensor]) -> dict[str, Any]:
    inputs, i = {}, 0
    for name, mask in spec.inputs:
        if mask is None:
            inputs[name], i = tensors[i], i + 1
        else:
            Nq, Nk, block_size, heavy = mask
            parts = dict(zip(_MASK_TENSORS, tensors[i:i + len(_MASK_TENSORS)]))
            inputs[name] = BlockMask(Nq=Nq, Nk=Nk, block_size=block_size, kv_heavy_blocks=heavy, **parts)
            i += len(_MASK_TENSORS)
    return inputs


@torch.library.custom_op("attnfuse::attention", mutates_args=())
def attention_op(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: Optional[torch.Tensor],
                 block_table: Optional[torch.Tensor], inputs: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Hq, Nq, DV) in q's memory order; lse (B, Hq, Nq) when the spec saves it, else (0,)."""
    spec = spec_of(key)
    values = _unflatten(spec, inputs)
    if spec.grad:  # the checks a differentiable call makes (the backward's plan is kept for later)
        _differentiable(spec, q, k, v, kv_lens, block_table, values)
    with torch.no_grad():
        result = run_attention(spec.graph, q, k, v, values, return_lse=spec.save_lse, kv_lens=kv_lens,
                               block_table=block_table, split_kv=False if spec.grad else None)
    return result if spec.save_lse else (result, q.new_empty(0, dtype=torch.float32))


@attention_op.register_fake
def _attention_fake(key, q, k, v, kv_lens, block_table, inputs):
    spec = spec_of(key)
    out = empty_like_layout(q, v.shape[-1], q.dtype)
    if not spec.save_lse:
        return out, q.new_empty(0, dtype=torch.float32)
    return out, q.new_empty(q.shape[:3], dtype=accumulator_dtype(q.dtype))


def _tensor_grads(spec: CallSpec, tiled) -> tuple:
    """The (instance, parameter) pairs writing the gradients of ``spec.grads``; an InputError for an input
    whose combinator declares no gradient for it."""
    wanted = tuple((m, name) for m in tiled.mods for name, _ in m.fragment.tensor_grads
                   if m.apply.inputs().get(name) is not None and m.apply.inputs()[name].name in spec.grads)
    covered = {m.apply.inputs()[name].name for m, name in wanted}
    for inst in tiled.instances():
        for param, sym in inst.apply.inputs().items():
            if sym.name in spec.grads and sym.name not in covered:
                raise InputError(f"{inst.apply.combinator}: its input {param!r} (argument {sym.name!r}) requires "
                                 f"grad, but {inst.apply.combinator} declares no gradient for it; pass it detached")
    return wanted


def _differentiable(spec, q, k, v, kv_lens, block_table, values):
    """The backward kernels of a differentiable call (raising as ``run_attention`` does when there are none)."""
    forward, _, backward = _plan(spec.graph, q, k, v, kv_lens, block_table, spec.save_lse, True, False)
    tensor_grads = _tensor_grads(spec, forward.tiled) if spec.grads else ()
    if tensor_grads:
        compile_ = compile_hoisted_backward if isinstance(forward, HoistedForward) else compile_backward
        backward = compile_(spec.graph, forward.tiled.config, tensor_grads)
    return backward


@torch.library.custom_op("attnfuse::attention_backward", mutates_args=())
def attention_backward_op(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor],
                          kv_lens: Optional[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """[dq, dk, dv, *gradients of spec.grads], each in its input's shape, dtype and memory order."""
    spec = spec_of(key)
    values = _unflatten(spec, inputs)
    backward = _differentiable(spec, q, k, v, kv_lens, None, values)
    kv = kv_cache(k, v, kv_lens, None)
    dq, dk, dv, grads = backward(q, kv, out, lse if spec.save_lse else None, dout, dlse, values)
    return [dq, dk, dv, *(grads[name] for name in spec.grads)]


@attention_backward_op.register_fake
def _attention_backward_fake(key, q, k, v, out, lse, dout, dlse, kv_lens, inputs):
    spec = spec_of(key)
    values = dict(zip((name for name, mask in spec.inputs if mask is None),
                      (t for t in _unflatten_tensors(spec, inputs))))
    grads = [empty_like_layout(t, t.shape[-1], t.dtype) for t in (q, k, v)]
    return grads + [values[name].new_empty(values[name].shape) for name in spec.grads]


def _unflatten_tensors(spec: CallSpec, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The plain tensor inputs of the list, in order (block masks' tensors left out)."""
    found, i = [], 0
    for _, mask in spec.inputs:
        if mask is None:
            found.append(tensors[i])
        i += 1 if mask is None else len(_MASK_TENSORS)
    return found


def _setup_context(ctx, inputs, output):
    key, q, k, v, kv_lens, block_table, tensors = inputs
    out, lse = output
    ctx.key, ctx.count = key, len(tensors)
    ctx.save_for_backward(q, k, v, out, lse, kv_lens, *tensors)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_lens, *tensors = ctx.saved_tensors
    spec = spec_of(ctx.key)
    dout = torch.zeros_like(out) if dout is None else dout
    grads = attention_backward_op(ctx.key, q, k, v, out, lse, dout, dlse if spec.save_lse else None, kv_lens, tensors)
    by_name = dict(zip(spec.grads, grads[3:]))
    names = [name for name, mask in spec.inputs for _ in range(1 if mask is None else len(_MASK_TENSORS))]
    return None, grads[0], grads[1], grads[2], None, None, [by_name.get(n) for n in names]


def _no_second_derivative(ctx, *grads):
    raise RuntimeError("attnfuse: second derivatives are not supported (a gradient taken with create_graph=True "
                       "cannot be differentiated again): the backward kernels are not differentiable")


attention_op.register_autograd(_backward, setup_context=_setup_context)
attention_backward_op.register_autograd(_no_second_derivative, setup_context=lambda ctx, inputs, output: None)


def opaque_to_dynamo(fn):
    """``fn`` as one opaque call to Dynamo (``torch._dynamo.nonstrict_trace``): AOT autograd runs it on fake
    tensors and records the op it calls. Its arguments must be tensors, constants, or pytree types."""
    return torch._dynamo.nonstrict_trace(fn)


def register_constant(cls: type) -> None:
    """Let instances of ``cls`` (hashable, compared by identity) be arguments of an opaque function."""
    pytree.register_constant(cls)


class _NoneArgument:
    """Stands for None in the arguments of an opaque function (Dynamo refuses None there)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoneArgument)

    def __hash__(self) -> int:
        return 0


_NONE = _NoneArgument()
pytree.register_constant(_NoneArgument)


def hide_none(value: Any) -> Any:
    """``value`` with None (also inside tuples, lists and dict values) replaced by a placeholder."""
    if value is None:
        return _NONE
    if isinstance(value, (tuple, list)):
        return type(value)(hide_none(v) for v in value)
    if isinstance(value, dict):
        return {k: hide_none(v) for k, v in value.items()}
    return value


def show_none(value: Any) -> Any:
    """The inverse of ``hide_none``."""
    if isinstance(value, _NoneArgument):
        return None
    if isinstance(value, (tuple, list)):
        return type(value)(show_none(v) for v in value)
    if isinstance(value, dict):
        return {k: show_none(v) for k, v in value.items()}
    return value


def _flatten_mask(mask: BlockMask) -> tuple[list[torch.Tensor], tuple]:
    return [getattr(mask, t) for t in _MASK_TENSORS], (mask.Nq, mask.Nk, mask.block_size, mask.kv_heavy_blocks)


def _unflatten_mask(tensors, sizes: tuple) -> BlockMask:
    Nq, Nk, block_size, heavy = sizes
    return BlockMask(Nq=Nq, Nk=Nk, block_size=block_size, kv_heavy_blocks=heavy, **dict(zip(_MASK_TENSORS, tensors)))


pytree.register_pytree_node(BlockMask, _flatten_mask, _unflatten_mask,
                            serialized_type_name="attnfuse.BlockMask")


def call(graph: ir.MatMulPV, q: Any, k: Any, v: Any, inputs: dict[str, Any], *, return_lse: bool,
         kv_lens: Any, block_table: Any):
    """``run_attention``'s result through the op: out, or (out, lse) when ``return_lse``."""
    tensors = (q, k, v, *(t for t in (kv_lens, block_table) if t is not None))
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not all(
            isinstance(t, (torch.Tensor, BlockMask)) for t in inputs.values()):  # run_attention names the error
        return run_attention(graph, q, k, v, inputs, return_lse=return_lse, kv_lens=kv_lens, block_table=block_table)
    lse_kept = fragment_of(graph.weights.apply).has_lse
    if return_lse and not lse_kept:
        raise InputError(f"return_lse=True needs a normaliser with a log-sum-exp; "
                         f"{graph.weights.apply.combinator} has none (softmax has)")
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, *inputs.values()))
    grads = tuple(n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad) if grad else ()
    layout, flat = flatten_inputs(inputs)
    spec = CallSpec(graph=graph, inputs=layout, save_lse=return_lse or (grad and lse_kept), grad=grad, grads=grads)
    out, lse = attention_op(call_key(spec), q, k, v, kv_lens, block_table, flat)
    return (out, lse) if return_lse else out
