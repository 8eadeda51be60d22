"""``torch.autograd.Function`` around the fused forward and the backward kernels."""
from __future__ import annotations

from typing import Any

import torch

from .backward import BackwardKernels
from .forward import ForwardKernel


class AttentionFunction(torch.autograd.Function):
    """out, lse = f(q, k, v, *tensor_inputs); the forward saves one log-sum-exp per query row."""

    @staticmethod
    def forward(ctx, forward: ForwardKernel, backward: BackwardKernels, inputs: dict[str, Any],
                grad_inputs: tuple[str, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                *tensor_inputs: torch.Tensor):
        out, lse = forward(q, k, v, inputs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward_kernels, ctx.inputs, ctx.grad_inputs = backward, inputs, grad_inputs
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, grads = ctx.backward_kernels(q, k, v, out, lse, dout, dlse, ctx.inputs)
        return (None, None, None, None, dq, dk, dv, *(grads.get(name) for name in ctx.grad_inputs))
