"""``torch.autograd.Function`` around the fused forward and the backward kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..block_mask import BlockMask
from .gradients import no_double_backward
from .dropout import Dropout
from .inputs import Positions, kv_cache
from .packed import Packed

if TYPE_CHECKING:
    from .call import Call


def runtime_tensors(inputs: dict[str, Any]) -> tuple[list[torch.Tensor], list[str | None]]:
    """Every tensor of a call's runtime inputs (a ``BlockMask``'s tensors too), and for each the argument
    name of a tensor input, or None for a mask's tensor."""
    tensors: list[torch.Tensor] = []
    names: list[str | None] = []
    for name, value in inputs.items():
        if isinstance(value, BlockMask):
            value.check_unchanged()
            parts = list(value.tensors())
            tensors += parts
            names += [None] * len(parts)
        else:
            tensors.append(value)
            names.append(name)
    return tensors, names


class AttentionFunction(torch.autograd.Function):
    """out, lse = f(q, k, v, kv_lens, *tensors), ``tensors`` every tensor of the runtime inputs and ``names``
    their names (``runtime_tensors``). The forward saves one log-sum-exp per query row, and with hoisted qk
    transforms the transformed copies of q and k, which the backward reads instead of transforming q and k
    again. The plugins prepare their kernel arguments once, for both.

    The forward saves the caller's kv_lens and runtime tensors themselves, not copies the plugins prepared, so
    that editing one in place before the backward raises torch's "modified by an inplace operation" error
    rather than giving gradients of the new values.

    First order only: a gradient taken with ``create_graph=True`` is connected to q, k, v, the tensor inputs
    and the incoming gradients through a node whose backward raises ``af.UnsupportedError``, so differentiating
    it again raises, whatever the incoming gradient (``once_differentiable`` raises only when the incoming
    gradient requires grad: a constant one such as ``out.sum()``'s dropped the second-order term silently)."""

    @staticmethod
    def forward(
        ctx,
        call: Call,
        inputs: dict[str, Any],
        names: tuple[str | None, ...],
        positions: Positions | None,
        packed: Packed | None,
        dropout: Dropout | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_lens: torch.Tensor | None,
        *tensors: torch.Tensor,
    ):
        """q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV) (no gradient flows through a paged cache),
        kv_lens (B,) or None, the call's positions or None, its packed documents' offsets or None, its attention
        dropout or None (kept as they are: integers, no gradient; the backward regenerates dropout's mask from
        its state); ``inputs`` the runtime inputs by name, whose
        tensors are ``tensors``; ``call`` the kernels of the call's signature."""
        kv = kv_cache(k, v, kv_lens, None, positions, packed=packed, dropout=dropout)
        prepared = call.prepare(q, kv, inputs)
        out, lse, copies = call.run_forward(q, kv, inputs, prepared)
        ctx.save_for_backward(q, k, v, out, lse, kv_lens, *tensors, *copies.values())
        ctx.call, ctx.inputs, ctx.names, ctx.sides, ctx.prepared = call, inputs, names, tuple(copies), prepared
        ctx.positions, ctx.packed, ctx.dropout = positions, packed, dropout
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, out, lse, kv_lens, *rest = ctx.saved_tensors  # torch raises here if one was edited in place
        tensors, copies = rest[: len(ctx.names)], rest[len(ctx.names) :]
        call = ctx.call

        def gradients() -> tuple[torch.Tensor, ...]:
            kv = kv_cache(k, v, kv_lens, None, ctx.positions, packed=ctx.packed, dropout=ctx.dropout)
            dq, dk, dv, grads = call.run_backward(
                q, kv, out, lse, dout, dlse, ctx.inputs, ctx.prepared, dict(zip(ctx.sides, copies))
            )
            return dq, dk, dv, *(grads[name] for name in call.grads)

        if torch.is_grad_enabled():  # create_graph=True: the results must raise if differentiated again
            wanted = (t for t, name in zip(tensors, ctx.names) if name in call.grads)
            anchors = (t for t in (q, k, v, dout, dlse, *wanted) if t is not None)
            dq, dk, dv, *grads = _FirstOrderOnly.apply(gradients, *anchors)
        else:
            dq, dk, dv, *grads = gradients()
        by_name = dict(zip(call.grads, grads))
        return (None, None, None, None, None, None, dq, dk, dv, None, *(by_name.get(name) for name in ctx.names))


class _FirstOrderOnly(torch.autograd.Function):
    """The gradients ``compute()`` returns, as outputs of a node whose inputs are ``anchors`` (every tensor they
    depend on that may require grad) and whose backward raises ``af.UnsupportedError``."""

    @staticmethod
    def forward(ctx, compute: Callable[[], tuple[torch.Tensor, ...]], *anchors: torch.Tensor):
        return compute()

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        raise no_double_backward()
