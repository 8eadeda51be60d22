"""The op boundary: under ``torch.compile`` every program call is ``torch.ops.attnfuse.attention``, opaque.

``call`` describes the call by a ``CallSpec`` (see ``call_spec``) and passes its key, a string, as the op's
static argument; the tensors are q, k, v, kv_lens?, block_table? and the runtime inputs as one list (a
``BlockMask`` flattened into its tensors). Under Dynamo, the program's binding of its arguments runs as
``opaque_program_call`` (``torch._dynamo.nonstrict_trace``), so Dynamo traces none of AttnFuse's Python and
AOT autograd records just the op. The backward is a second op, ``attnfuse::attention_backward``, registered
as the first one's autograd formula, so the backward kernels run under compile too. Both bodies run the
``Call`` an eager call of the same signature runs (``runtime.launch.planned``). A differentiable call whose
plan hoists the qk transforms returns the transformed q and k rows as a third output, which the backward
reads instead of transforming again.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.utils._pytree as pytree

from . import ir
from .block_mask import BlockMask
from .call_spec import flatten_inputs, key_of, plain_tensors, spec_of, tensor_names, unflatten_inputs
from .runtime import gradients
from .runtime.launch import hoisted_sides, keeps_lse, planned, run_attention, wanted_grads
from .runtime import dropout as dropout_runtime
from .runtime.dropout import dropout_state, op_dropout
from .runtime.inputs import accumulator_dtype, check_cache, empty_like_layout, kv_cache
from .runtime.kv_layout import check_kv_layout
from .runtime.offsets import inputs_fit
from .runtime.validate import check_call_values

_LIBRARY = torch.library.Library("attnfuse", "DEF")  # not torch.library.custom_op: its wrappers cost ~60 us a call
_LIBRARY.define(
    "attention(str key, Tensor q, Tensor k, Tensor v, Tensor? kv_lens, Tensor? block_table, "
    "Tensor[] inputs, Tensor? dropout_state=None) -> (Tensor, Tensor, Tensor[])"
)
_LIBRARY.define(
    "attention_backward(str key, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
    "Tensor? dlse, Tensor? kv_lens, Tensor[] inputs, Tensor[] copies, Tensor? dropout_state=None) -> Tensor[]"
)


def _attention(
    key: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    inputs: list[torch.Tensor],
    dropout_state: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """out (B, Hq, Nq, DV) in q's memory order; lse (B, Hq, Nq) when the spec saves it, else (0,); the
    transformed rows of the hoisted sides ("q", "k" order) of a differentiable hoisted call, else [].
    ``dropout_state``: the call's (2,) int64 dropout state when the spec has dropout (``runtime/dropout.py``)."""
    spec = spec_of(key)
    values = unflatten_inputs(spec, inputs)
    dropout = op_dropout(spec.dropout_p, dropout_state, q.device)
    call = planned(
        spec.graph,
        q,
        k,
        v,
        values,
        kv_lens,
        block_table,
        return_lse=spec.save_lse,
        grads=spec.grads if spec.grad else None,
        split_kv=False if spec.grad else None,
        kv_layout=spec.kv_layout,
        dropout=dropout is not None,
    )
    check_call_values(
        k, kv_lens, block_table, kv_layout=call.kv_layout, validate=spec.validate
    )  # as an eager call: on the device
    if not spec.grad:
        out, lse = call(q, k, v, values, kv_lens, block_table, dropout=dropout)
        copies = {}
    else:
        kv = kv_cache(k, v, kv_lens, None, dropout=dropout)
        out, lse, copies = call.run_forward(q, kv, values, call.prepare(q, kv, values))
    return out, q.new_empty(0, dtype=torch.float32) if lse is None else lse, list(copies.values())


@torch.library.register_fake("attnfuse::attention", lib=_LIBRARY)
def _attention_fake(key, q, k, v, kv_lens, block_table, inputs, dropout_state=None):
    """The outputs' metadata; the inputs' checks run here too, so a bad call fails while it is compiled (and
    meta tensors, which take this path, are refused as ``run_attention`` refuses them)."""
    spec = spec_of(key)
    check_cache(q, k, v, kv_lens, block_table, spec.kv_layout)
    out = empty_like_layout(q, v.shape[-1], q.dtype)
    lse = (
        q.new_empty(q.shape[:3], dtype=accumulator_dtype(q.dtype))
        if spec.save_lse
        else q.new_empty(0, dtype=torch.float32)
    )
    sides = (
        hoisted_sides(
            spec.graph, q, k, v, kv_lens, spec.save_lse, bool(inputs) and not inputs_fit(unflatten_inputs(spec, inputs))
        )
        if spec.grad and block_table is None
        else ()
    )
    rows = {"q": q, "k": k}
    return out, lse, [empty_like_layout(rows[x], rows[x].shape[3], rows[x].dtype) for x in sides]


def _attention_backward(
    key: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: Optional[torch.Tensor],
    kv_lens: Optional[torch.Tensor],
    inputs: list[torch.Tensor],
    copies: list[torch.Tensor],
    dropout_state: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """[dq, dk, dv, *gradients of spec.grads], each in its input's shape, dtype and memory order."""
    spec = spec_of(key)
    values = unflatten_inputs(spec, inputs)
    dropout = op_dropout(spec.dropout_p, dropout_state, q.device)
    call = planned(
        spec.graph,
        q,
        k,
        v,
        values,
        kv_lens,
        None,
        return_lse=spec.save_lse,
        grads=spec.grads,
        split_kv=False,
        dropout=dropout is not None,
    )
    dq, dk, dv, grads = call.run_backward(
        q,
        kv_cache(k, v, kv_lens, None, dropout=dropout),
        out,
        lse if spec.save_lse else None,
        dout,
        dlse,
        values,
        None,
        dict(zip(call.sides, copies)),
    )
    return [dq, dk, dv, *(grads[name] for name in spec.grads)]


@torch.library.register_fake("attnfuse::attention_backward", lib=_LIBRARY)
def _attention_backward_fake(key, q, k, v, out, lse, dout, dlse, kv_lens, inputs, copies, dropout_state=None):
    spec = spec_of(key)
    tensors = plain_tensors(spec, inputs)
    grads = [empty_like_layout(t, t.shape[-1], t.dtype) for t in (q, k, v)]
    return grads + [tensors[name].new_empty(tensors[name].shape) for name in spec.grads]


def _setup_context(ctx, inputs, output):
    key, q, k, v, kv_lens, _, tensors, dropout_state = inputs  # torch fills in the defaults here
    out, lse, copies = output
    ctx.key, ctx.counts = key, (len(tensors), len(copies))
    # the op received a dropout_state of None as its default, which the dispatcher drops: no gradient slot for it
    ctx.arguments = len(inputs) - (dropout_state is None)
    ctx.save_for_backward(q, k, v, out, lse, kv_lens, dropout_state, *tensors, *copies)


def _backward(ctx, dout, dlse, _):
    q, k, v, out, lse, kv_lens, dropout_state, *rest = ctx.saved_tensors
    tensors, copies = rest[: ctx.counts[0]], rest[ctx.counts[0] :]
    spec = spec_of(ctx.key)
    dout = torch.zeros_like(out) if dout is None else dout
    grads = torch.ops.attnfuse.attention_backward(
        ctx.key, q, k, v, out, lse, dout, dlse if spec.save_lse else None, kv_lens, tensors, copies, dropout_state
    )
    by_name = dict(zip(spec.grads, grads[3:]))
    found = (None, grads[0], grads[1], grads[2], None, None, [by_name.get(n) for n in tensor_names(spec)], None)
    return found[: ctx.arguments]


def _no_second_derivative(ctx, *grads):
    raise gradients.no_double_backward()


for _device in ("CPU", "CUDA"):
    _LIBRARY.impl("attention", _attention, _device)
    _LIBRARY.impl("attention_backward", _attention_backward, _device)
torch.library.register_autograd("attnfuse::attention", _backward, setup_context=_setup_context, lib=_LIBRARY)
torch.library.register_autograd(
    "attnfuse::attention_backward", _no_second_derivative, setup_context=lambda ctx, inputs, output: None, lib=_LIBRARY
)


def call(
    graph: ir.MatMulPV,
    q: Any,
    k: Any,
    v: Any,
    inputs: dict[str, Any],
    *,
    return_lse: bool,
    kv_lens: Any,
    block_table: Any,
    validate: bool = True,
    kv_layout: Any = None,
    dropout_p: float = 0.0,
):
    """``run_attention``'s result through the op: out, or (out, lse) when ``return_lse``. With ``dropout_p`` >
    0 the call's dropout state is drawn here, ahead of the op (an op of the graph under torch.compile)."""
    tensors = (q, k, v, *(t for t in (kv_lens, block_table) if t is not None))
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not all(
        isinstance(t, (torch.Tensor, BlockMask)) for t in inputs.values()
    ):  # run_attention names the error
        return run_attention(
            graph,
            q,
            k,
            v,
            inputs,
            return_lse=return_lse,
            kv_lens=kv_lens,
            block_table=block_table,
            validate=validate,
            kv_layout=kv_layout,
            dropout_p=dropout_p,
        )
    check_kv_layout(kv_layout, block_table is not None)  # a CallSpec takes only a layout a call may name
    lse_kept = keeps_lse(graph, return_lse)
    grads = wanted_grads(q, k, v, inputs)
    layout, flat = flatten_inputs(inputs)
    key = key_of(
        graph,
        layout,
        return_lse or (grads is not None and lse_kept),
        grads is not None,
        grads or (),
        validate,
        kv_layout,
        dropout_p,
    )
    if dropout_p > 0.0:
        dropout_runtime.GATE.check(q.device)
    state = dropout_state(q.device) if dropout_p > 0.0 else None
    out, lse, _ = torch.ops.attnfuse.attention.default(key, q, k, v, kv_lens, block_table, flat, state)
    return (out, lse) if return_lse else out


PROGRAM_CALL: Any = None  # program._call: binds a call's arguments and calls ``call``


def __getattr__(name: str) -> Any:
    """``opaque_program_call``: ``PROGRAM_CALL`` of ``hide_none``'s arguments, as one opaque call to Dynamo
    (``torch._dynamo.nonstrict_trace``): AOT autograd runs it on fake tensors and records the op it calls. Its
    arguments must be tensors, constants or pytree types, and not None. Made on first use, which is Dynamo's
    lookup while it traces a program call, so ``import attnfuse`` does not import torch._dynamo."""
    if name != "opaque_program_call":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch._dynamo

    def program_call(*args: Any):
        return PROGRAM_CALL(*show_none(args))

    made = globals()[name] = torch._dynamo.nonstrict_trace(program_call)
    return made


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
register_constant(_NoneArgument)


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
    return list(mask.tensors()), (mask.Nq, mask.Nk, mask.block_size, mask.kv_heavy_blocks)


def _unflatten_mask(tensors, sizes: tuple) -> BlockMask:
    return BlockMask.rebuilt(sizes, tensors)


pytree.register_pytree_node(BlockMask, _flatten_mask, _unflatten_mask, serialized_type_name="attnfuse.BlockMask")
