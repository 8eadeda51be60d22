"""Tests of attnfuse-sigmoid: the conformance kit, fixed programs against hand-written float64 math,
parameter errors and the distribution's registration."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import attnfuse as af
from attnfuse.testing import assert_matches_reference

CASES = [pytest.param("cpu", dtype, id=f"cpu-{str(dtype)[6:]}") for dtype in (torch.float32, torch.float16)]
if torch.cuda.is_available():
    CASES += [
        pytest.param("cuda", dtype, id=f"cuda-{str(dtype)[6:]}")
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    ]


def test_conforms(attnfuse_conformance):
    attnfuse_conformance("sigmoid_attention")


def test_registered_by_its_distribution():
    entry = af.combinators()["sigmoid_attention"]
    assert entry.distribution == "attnfuse-sigmoid"
    assert entry.combinator.role is af.Role.NORMALISER


@af.attention
def sigmoid_causal(q, k, v):
    return af.sigmoid_attention(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def sigmoid_causal_biased(q, k, v):
    return af.sigmoid_attention(af.causal(af.scaled_dot_product(q, k)), bias=-2.0) @ v


def by_hand(q, k, v, bias):
    """float64: sigmoid(q·kᵀ/√D + b) on the causal (bottom-right) pattern, times v."""
    q, k, v = (t.double() for t in (q, k, v))
    Nq, Nk, D = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + (-math.log(Nk) if bias is None else bias)
    w = 1.0 / (1.0 + torch.exp(-s))
    keep = torch.arange(Nk)[None, :] <= torch.arange(Nq)[:, None] + (Nk - Nq)
    return torch.where(keep, w, torch.zeros_like(w)) @ v


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 2, 37, 53, 32), (1, 2, 1, 64, 64, 16), (1, 1, 1, 5, 70, 64)],
    ids=lambda s: "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*s),
)
def test_matches_float64_by_hand(device, dtype, shape):
    B, Hq, Hkv, Nq, Nk, D = shape
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype)).encode()))
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype).to(device)
    out = sigmoid_causal(q, k, v)
    want = by_hand(q.cpu(), k.cpu(), v.cpu(), None)
    assert_matches_reference(out, want, sigmoid_causal.reference(q, k, v, dtype=dtype), dtype)


def test_gradients_match_by_hand():
    @af.attention
    def biased(q, k, v):
        return af.sigmoid_attention(af.causal(af.scaled_dot_product(q, k)), bias=-1.5) @ v

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 2, 24, 16, generator=g)
    got = torch.autograd.grad(biased(q, k, v), (q, k, v), dout)
    want = torch.autograd.grad(by_hand(q, k, v, -1.5), (q, k, v), dout.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=0)


def test_split_kv_decoding_adds_splits():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 3, 32, generator=g)
    k, v = torch.randn(2, 1, 200, 32, generator=g), torch.randn(2, 1, 200, 32, generator=g)
    lens = torch.tensor([200, 90], dtype=torch.int32)
    out = sigmoid_causal(q, k, v, kv_lens=lens)
    for b, n in enumerate(lens.tolist()):
        want = by_hand(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], -math.log(200))
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("bias", ["x", math.inf, math.nan, True])
def test_bad_bias_is_a_program_error_naming_bias(bias):
    @af.attention
    def bad(q, k, v):
        return af.sigmoid_attention(af.scaled_dot_product(q, k), bias=bias) @ v

    with pytest.raises(af.ProgramError, match="bias"):
        bad.graph()


def test_no_lse():
    q = torch.randn(1, 1, 4, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(af.InputError, match="lse"):
        sigmoid_causal(q, q, q, return_lse=True)


def test_packed_calls_take_an_explicit_bias_and_refuse_the_default():
    """A packed call with bias=None is refused (each document would need -log of its own key count); with a
    number, each document matches the reference run alone."""
    torch.manual_seed(0)
    lengths = [5, 30]
    q, k, v = (torch.randn(1, 2, sum(lengths), 16) for _ in range(3))
    cu = torch.tensor([0, 5, 35], dtype=torch.int32)
    with pytest.raises(af.UnsupportedError, match="bias=None.*packed call.*pass bias="):
        sigmoid_causal(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out = sigmoid_causal_biased(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for start, n in zip(cu[:-1].tolist(), lengths):
        rows = slice(start, start + n)
        ref = sigmoid_causal_biased.reference(q[:, :, rows], k[:, :, rows], v[:, :, rows])
        assert_matches_reference(out[:, :, rows], ref, ref.float(), torch.float32)
