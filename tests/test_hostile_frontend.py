"""Hostile use of the front end: what used to give silently wrong results or errors that named nothing."""
import pytest
import torch

import attnfuse as af


@af.attention
def causal_softmax(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


def _qkv(seed, B=1, H=2, N=32, D=16, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3))


# 1. Double backward ------------------------------------------------------------------------------------------

def test_second_derivative_raises_and_first_derivative_matches_reference():
    q, k, v = _qkv(0, requires_grad=True)
    out = causal_softmax(q, k, v)
    gq, gk, gv = torch.autograd.grad(out.pow(2).sum(), (q, k, v), create_graph=True)
    with pytest.raises(RuntimeError):  # the gradient is not connected to q: no silent zero
        torch.autograd.grad(gq.sum(), (q, k, v))
    with pytest.raises(RuntimeError, match="differentiate twice a function that was marked with @once_diff"):
        gq.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(causal_softmax.reference(q64, k64, v64).pow(2).sum(), (q64, k64, v64))
    for got, want in zip((gq, gk, gv), ref):
        torch.testing.assert_close(got.detach().double(), want, atol=5e-5, rtol=0)
