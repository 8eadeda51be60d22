"""``torch.autograd.Function`` around the fused forward and the backward kernels."""
from __future__ import annotations

from typing import Any

import torch

from .backward import BackwardKernels
from .forward import ForwardKernel
from .hoisted import HoistedBackward, HoistedForward
from .inputs import KVCache


class AttentionFunction(torch.autograd.Function):
    """out, lse = f(q, k, v, *tensor_inputs); the forward saves one log-sum-exp per query row."""

    @staticmethod
    def forward(ctx, forward: ForwardKernel | HoistedForward, backward: BackwardKernels | HoistedBackward,
                inputs: dict[str, Any], grad_inputs: tuple[str, ...], lens: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, *tensor_inputs: torch.Tensor):
        out, lse = forward(q, KVCache(k=k, v=v, capacity=k.shape[2], lens=lens), inputs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward_kernels, ctx.inputs, ctx.grad_inputs, ctx.lens = backward, inputs, grad_inputs, lens
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        kv = KVCache(k=k, v=v, capacity=k.shape[2], lens=ctx.lens)
        dq, dk, dv, grads = ctx.backward_kernels(q, kv, out, lse, dout, dlse, ctx.inputs)
        return (None, None, None, None, None, dq, dk, dv, *(grads.get(name) for name in ctx.grad_inputs))
