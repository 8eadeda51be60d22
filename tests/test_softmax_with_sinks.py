"""The built-in softmax_with_sinks (attention sinks, GPT-OSS): the conformance kit, fixed programs against
hand-written float64 math (out, lse and gradients), fully masked rows, the input errors and its registration."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import attnfuse as af
from attnfuse.testing import assert_matches_reference

CASES = [pytest.param("cpu", dtype, id=f"cpu-{str(dtype)[6:]}") for dtype in (torch.float32, torch.float16)]
if torch.cuda.is_available():
    CASES += [pytest.param("cuda", dtype, id=f"cuda-{str(dtype)[6:]}")
              for dtype in (torch.float32, torch.float16, torch.bfloat16)]


def test_conforms(attnfuse_conformance):
    attnfuse_conformance("softmax_with_sinks")


def test_is_a_builtin():
    entry = af.combinators()["softmax_with_sinks"]
    assert entry.distribution == "attnfuse"
    assert entry.combinator.role is af.Role.NORMALISER


@af.attention
def windowed(q, k, v, sinks):
    return af.softmax_with_sinks(af.sliding_window(af.scaled_dot_product(q, k), 9), sinks) @ v


def by_hand(q, k, v, sinks, left=9):
    """float64: the sink's exp joins the denominator of a sliding-window softmax; (out, lse)."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    Nq, Nk, D = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    pos = torch.arange(Nq)[:, None] + (Nk - Nq)
    keep = (torch.arange(Nk)[None, :] <= pos) & (torch.arange(Nk)[None, :] >= pos - left)
    e = torch.where(keep, torch.exp(s), torch.zeros_like(s))
    total = torch.exp(sinks).view(1, -1, 1, 1) + e.sum(-1, keepdim=True)
    return (e / total) @ v, torch.log(total).squeeze(-1)


def inputs(shape, dtype, device, seed):
    B, Hq, Hkv, Nq, Nk, D = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype).to(device)
    return q, k, v, (torch.randn(Hq, generator=g) * 2).to(device)


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 53, 32), (1, 2, 1, 64, 64, 16), (1, 2, 2, 70, 20, 64)],
                         ids=lambda s: "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*s))
def test_matches_float64_by_hand(device, dtype, shape):
    q, k, v, sinks = inputs(shape, dtype, device, zlib.crc32(repr((shape, dtype)).encode()))
    out, lse = windowed(q, k, v, sinks, return_lse=True)
    want_out, want_lse = by_hand(q.cpu(), k.cpu(), v.cpu(), sinks.cpu())
    ref_out, ref_lse = windowed.reference(q, k, v, sinks, return_lse=True, dtype=dtype)
    assert_matches_reference(out, want_out, ref_out, dtype, what="out")
    assert_matches_reference(lse, want_lse, ref_lse, dtype, what="lse")


def test_fully_masked_rows_give_zero_and_the_sink():
    """Nq > Nk: queries at negative positions keep no key; their weight all goes to the sink."""
    q, k, v, sinks = inputs((1, 2, 1, 30, 12, 16), torch.float32, "cpu", 11)
    out, lse = windowed(q, k, v, sinks, return_lse=True)
    empty = slice(0, 30 - 12)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    torch.testing.assert_close(lse[0, :, empty], sinks[:, None].expand(2, 18), atol=1e-6, rtol=0)


def test_gradients_match_by_hand():
    q, k, v, sinks = inputs((1, 2, 1, 24, 40, 16), torch.float32, "cpu", 7)
    for t in (q, k, v):
        t.requires_grad_(True)
    dout = torch.randn(1, 2, 24, 16, generator=torch.Generator().manual_seed(8))
    got = torch.autograd.grad(windowed(q, k, v, sinks), (q, k, v), dout)
    want = torch.autograd.grad(by_hand(q, k, v, sinks)[0], (q, k, v), dout.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=0)


def test_decoding_with_kv_lens():
    q, k, v, sinks = inputs((2, 2, 1, 3, 90, 32), torch.float32, "cpu", 9)
    lens = torch.tensor([90, 41], dtype=torch.int32)
    out = windowed(q, k, v, sinks, kv_lens=lens)
    for b, n in enumerate(lens.tolist()):
        want, _ = by_hand(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], sinks)
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=2e-5, rtol=0)


SHAPE_OR_DTYPE = r"softmax_with_sinks: sinks must be a float tensor of shape \(Hq,\) = \(2,\)"


@pytest.mark.parametrize("sinks, says", [(torch.zeros(3), SHAPE_OR_DTYPE),
                                         (torch.zeros(2, dtype=torch.int64), SHAPE_OR_DTYPE),
                                         ([0.0, 0.0], r"argument 'sinks' must be a tensor")],
                         ids=["shape", "dtype", "list"])
def test_bad_sinks_is_an_input_error_naming_sinks(sinks, says):
    q, k, v, _ = inputs((1, 2, 1, 4, 8, 16), torch.float32, "cpu", 0)
    with pytest.raises(af.InputError, match=says):
        windowed(q, k, v, sinks)
