"""``torch.autograd.Function`` around the fused forward and the backward kernels."""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .backward import BackwardKernels
from .forward import ForwardKernel
from .hoisted import HoistedBackward, HoistedForward
from .inputs import KVCache


class AttentionFunction(torch.autograd.Function):
    """out, lse = f(q, k, v, *tensor_inputs); the forward saves one log-sum-exp per query row, and with
    hoisted qk transforms the transformed copies of q and k, which the backward reads instead of
    transforming q and k again. The plugins prepare their kernel arguments once, for both.

    Once differentiable: a gradient taken with ``create_graph=True`` cannot be differentiated again (torch
    raises a RuntimeError), rather than silently acting as a constant in a gradient penalty."""

    @staticmethod
    def forward(ctx, forward: ForwardKernel | HoistedForward, backward: BackwardKernels | HoistedBackward,
                inputs: dict[str, Any], grad_inputs: tuple[str, ...], kv: KVCache, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, *tensor_inputs: torch.Tensor):
        """``kv``: the call's view of k and v (contiguous: no gradient flows through a paged cache)."""
        prepared = forward.plugin_args(q, kv, inputs)
        if isinstance(forward, HoistedForward):  # keep the transformed q and k for the hoisted backward
            out, lse, copies = forward.run(q, kv, inputs, prepared)
        else:
            (out, lse), copies = forward(q, kv, inputs, prepared), {}
        ctx.save_for_backward(q, k, v, out, lse, *copies.values())
        ctx.sides = tuple(copies)
        ctx.backward_kernels, ctx.inputs, ctx.grad_inputs = backward, inputs, grad_inputs
        ctx.kv = kv._replace(k=None, v=None)  # k and v are saved tensors
        ctx.prepared = prepared
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # the backward kernels are not differentiable: a second derivative raises
    def backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, out, lse, *copies = ctx.saved_tensors
        kv = ctx.kv._replace(k=k, v=v)
        extra = {"copies": dict(zip(ctx.sides, copies))} if ctx.sides else {}
        dq, dk, dv, grads = ctx.backward_kernels(q, kv, out, lse, dout, dlse, ctx.inputs, prepared=ctx.prepared,
                                                 **extra)
        return (None, None, None, None, None, dq, dk, dv, *(grads.get(name) for name in ctx.grad_inputs))
