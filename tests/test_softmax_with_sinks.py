"""The built-in softmax_with_sinks (attention sinks, GPT-OSS): fixed programs against hand-written float64 math
(out, lse and gradients), fully masked rows, the input errors and its registration (the conformance kit runs on
it in tests/test_conformance.py)."""

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
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 2, 37, 53, 32), (1, 2, 1, 64, 64, 16), (1, 2, 2, 70, 20, 64)],
    ids=lambda s: "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*s),
)
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
        want, _ = by_hand(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], sinks)
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=2e-5, rtol=0)


# Non-finite sinks. A sink of -inf takes no weight: a row with keys gets plain softmax, a row that keeps no key
# (a masked row, kv_lens 0) output 0 and lse -inf, the sink. +inf takes all the weight: output 0, lse +inf,
# gradients 0. NaN gives NaN in its head's rows alone. Checked on fresh random sinks with some heads non-finite,
# in the kernels (forward, decoding with kv_lens, backward) and the float64 reference, against the math.


def by_hand_rows(q, k, v, sinks, keep):
    """float64 (out, lse) of weights exp(s_j) / (exp(sink_h) + Σ_k exp(s_k)) over the keys ``keep`` (B, Hq,
    Nq, Nk) keeps: a row whose denominator is 0 (no key, a -inf sink) has out 0 and lse -inf."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[3])
    e = torch.where(keep, torch.exp(s), torch.zeros_like(s))
    total = torch.exp(sinks).view(1, -1, 1, 1) + e.sum(-1, keepdim=True)
    return (e / torch.where(total == 0, torch.ones_like(total), total)) @ v, torch.log(total).squeeze(-1)


def window_keep(B, Hq, Nq, Nk, left=9, lens=None):
    """(B, Hq, Nq, Nk): windowed's keys, with query i at position i + Nk_b - Nq (Nk_b = lens[b] or Nk)."""
    n = torch.full((B,), Nk) if lens is None else lens.long()
    pos = torch.arange(Nq)[None, :, None] + (n[:, None, None] - Nq)
    j = torch.arange(Nk)[None, None, :]
    keep = (j <= pos) & (j >= pos - left) & (j < n[:, None, None])
    return keep[:, None].expand(B, Hq, Nq, Nk)


def sinks_with(Hq, g, value, heads):
    """Random finite sinks, with ``value`` (-inf, inf, nan) at ``heads``."""
    sinks = torch.randn(Hq, generator=g) * 2
    sinks[list(heads)] = value
    return sinks


NO_KEY_CASES = {  # (B, Hq, Hkv, Nq, Nk, D), kv_lens: rows at negative positions, windows whose first tile
    # is masked for some rows (every row keeps keys), empty sequences (kv_lens 0) and few-query decoding
    "rows_before_the_keys": ((1, 4, 2, 40, 24, 16), None),
    "windows_past_their_first_tile": ((1, 4, 2, 64, 64, 16), None),
    "kv_lens_with_zeros": ((3, 4, 2, 20, 40, 16), [40, 0, 17]),
    "decoding_with_zeros": ((3, 4, 4, 2, 50, 32), [0, 50, 3]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", sorted(NO_KEY_CASES))
def test_negative_infinite_sinks_take_no_weight(case, dtype):
    """Heads with a -inf sink: plain softmax where the row keeps keys; out 0 and lse -inf where it keeps none;
    the other heads as before. Kernel and float64 reference against the math."""
    (B, Hq, Hkv, Nq, Nk, D), lens = NO_KEY_CASES[case]
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    q, k, v, _ = inputs((B, Hq, Hkv, Nq, Nk, D), dtype, "cpu", zlib.crc32(case.encode()))
    sinks = sinks_with(Hq, g, -math.inf, (0, 3))
    lens = None if lens is None else torch.tensor(lens, dtype=torch.int32)
    out, lse = windowed(q, k, v, sinks, return_lse=True, kv_lens=lens)
    keep = window_keep(B, Hq, Nq, Nk, lens=lens)
    want_out, want_lse = by_hand_rows(q, k, v, sinks, keep)
    ref_out, ref_lse = windowed.reference(q, k, v, sinks, return_lse=True, kv_lens=lens)
    ref_in_dtype = windowed.reference(q, k, v, sinks, return_lse=True, kv_lens=lens, dtype=dtype)
    assert_matches_reference(ref_out, want_out, ref_in_dtype[0], torch.float64, what="reference out")
    assert_matches_reference(ref_lse, want_lse, ref_in_dtype[1], torch.float64, what="reference lse")
    assert_matches_reference(out, want_out, ref_in_dtype[0], dtype, what="out")
    assert_matches_reference(lse, want_lse, ref_in_dtype[1], dtype, what="lse")
    empty = ~keep.any(-1)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[:, (0, 3)][empty[:, (0, 3)]]).all()
    plain = windowed_softmax(q, k, v, kv_lens=lens)  # a -inf sink is plain softmax
    assert_matches_reference(out[:, (0, 3)], want_out[:, (0, 3)], plain[:, (0, 3)], dtype, what="out, -inf heads")


@af.attention
def windowed_softmax(q, k, v):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 9)) @ v


@pytest.mark.parametrize("case", ["rows_before_the_keys", "windows_past_their_first_tile", "kv_lens_with_zeros"])
def test_negative_infinite_sinks_gradients(case):
    """Gradients of q, k, v against float64 autograd through the math: finite, and 0 for rows with no key."""
    (B, Hq, Hkv, Nq, Nk, D), lens = NO_KEY_CASES[case]
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()) + 1)
    q, k, v, _ = inputs((B, Hq, Hkv, Nq, Nk, D), torch.float32, "cpu", zlib.crc32(case.encode()))
    sinks = sinks_with(Hq, g, -math.inf, (1, 2))
    lens = None if lens is None else torch.tensor(lens, dtype=torch.int32)
    for t in (q, k, v):
        t.requires_grad_(True)
    dout = torch.randn(B, Hq, Nq, D, generator=g)
    got = torch.autograd.grad(windowed(q, k, v, sinks, kv_lens=lens), (q, k, v), dout)
    want = torch.autograd.grad(
        by_hand_rows(q, k, v, sinks, window_keep(B, Hq, Nq, Nk, lens=lens))[0], (q, k, v), dout.double()
    )
    ref = torch.autograd.grad(windowed.reference(q, k, v, sinks, kv_lens=lens), (q, k, v), dout.double())
    for name, a, b, r in zip("qkv", got, want, ref):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=0)
        torch.testing.assert_close(r.double(), b.double(), atol=1e-6, rtol=0)
    empty = ~window_keep(B, Hq, Nq, Nk, lens=lens).any(-1)
    assert torch.equal(got[0][empty], torch.zeros_like(got[0][empty]))


@pytest.mark.parametrize("case", ["rows_before_the_keys", "kv_lens_with_zeros"])
def test_positive_infinite_sinks_take_all_the_weight(case):
    """A +inf sink: out 0, lse +inf and no gradient in its heads' rows (the limit of the formula); the other
    heads as before."""
    (B, Hq, Hkv, Nq, Nk, D), lens = NO_KEY_CASES[case]
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()) + 2)
    q, k, v, _ = inputs((B, Hq, Hkv, Nq, Nk, D), torch.float32, "cpu", zlib.crc32(case.encode()))
    sinks = sinks_with(Hq, g, math.inf, (2,))
    lens = None if lens is None else torch.tensor(lens, dtype=torch.int32)
    q.requires_grad_(True)
    out, lse = windowed(q, k, v, sinks, return_lse=True, kv_lens=lens)
    want_out, want_lse = by_hand_rows(q.detach(), k, v, sinks, window_keep(B, Hq, Nq, Nk, lens=lens))
    ref_out, ref_lse = windowed.reference(q.detach(), k, v, sinks, return_lse=True, kv_lens=lens)
    for got, want in ((out, want_out), (lse, want_lse), (ref_out, want_out), (ref_lse, want_lse)):
        assert_matches_reference(got.detach(), want, want.to(got.dtype), got.dtype)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2])) and torch.isposinf(lse[:, 2]).all()
    (dq,) = torch.autograd.grad(out, q, torch.randn(B, Hq, Nq, D, generator=g))
    assert torch.isfinite(dq).all() and torch.equal(dq[:, 2], torch.zeros_like(dq[:, 2]))


def test_a_nan_sink_gives_nan_in_its_heads_rows_alone():
    """NaN in, NaN out, as the formula gives in torch: the head's rows, out and lse; the other heads exact."""
    g = torch.Generator().manual_seed(5)
    q, k, v, _ = inputs((1, 4, 2, 30, 24, 16), torch.float32, "cpu", 5)
    sinks = sinks_with(4, g, math.nan, (1,))
    out, lse = windowed(q, k, v, sinks, return_lse=True)
    ref_out, ref_lse = windowed.reference(q, k, v, sinks, return_lse=True)
    want_out, want_lse = by_hand_rows(q, k, v, sinks, window_keep(1, 4, 30, 24))
    for got in (out, ref_out):
        assert torch.isnan(got[:, 1]).all()
    for got in (lse, ref_lse):
        assert torch.isnan(got[:, 1]).all()
    others = [0, 2, 3]
    assert_matches_reference(out[:, others], want_out[:, others], ref_out[:, others].float(), torch.float32)
    assert_matches_reference(lse[:, others], want_lse[:, others], ref_lse[:, others].float(), torch.float32)


SHAPE_OR_DTYPE = r"softmax_with_sinks: sinks must be a float tensor of shape \(Hq,\) = \(2,\)"


@pytest.mark.parametrize(
    "sinks, says",
    [
        (torch.zeros(3), SHAPE_OR_DTYPE),
        (torch.zeros(2, dtype=torch.int64), SHAPE_OR_DTYPE),
        ([0.0, 0.0], r"argument 'sinks' must be a tensor"),
    ],
    ids=["shape", "dtype", "list"],
)
def test_bad_sinks_is_an_input_error_naming_sinks(sinks, says):
    q, k, v, _ = inputs((1, 2, 1, 4, 8, 16), torch.float32, "cpu", 0)
    with pytest.raises(af.InputError, match=says):
        windowed(q, k, v, sinks)


@pytest.mark.parametrize("value", [-math.inf, math.inf], ids=["-inf", "inf"])
def test_hf_sinks_with_their_gradient_keep_rows_with_no_key_at_zero(value):
    """attn_implementation="attnfuse" with GPT-OSS's s_aux requiring grad: a mask row that keeps no key (left
    padding) and heads whose sink is infinite give out and gradients against float64 autograd through the math,
    finite; the sink gradient of the finite heads too."""
    hf = pytest.importorskip("attnfuse.hf")
    B, Hq, Hkv, N, D = 2, 4, 2, 12, 16
    g = torch.Generator().manual_seed(17)
    q, k, v, _ = inputs((B, Hq, Hkv, N, N, D), torch.float32, "cpu", 17)
    sinks = sinks_with(Hq, g, value, (0, 3)).requires_grad_(True)
    keep = torch.ones(B, 1, N, N, dtype=torch.bool).tril()
    keep[0, :, :, :3] = False  # three left-padding keys: the first three query rows of sequence 0 keep none
    module = torch.nn.Module()
    module.is_causal = True
    for t in (q, k, v):
        t.requires_grad_(True)
    out, _ = hf.attention_forward(module, q, k, v, keep, scaling=D**-0.5, s_aux=sinks)
    dout = torch.randn(B, N, Hq, D, generator=g)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    finite = [1, 2]
    leaf = sinks.detach().double().requires_grad_(True)
    want_out, _ = by_hand_rows(
        q, k, v, torch.where(torch.isfinite(leaf), leaf, sinks.detach().double()), keep.expand(B, Hq, N, N)
    )
    want = torch.autograd.grad(want_out.transpose(1, 2), (q, k, v, leaf), dout.double())
    assert_matches_reference(out.detach().transpose(1, 2), want_out.detach(), want_out.detach().float(), torch.float32)
    for name, a, b in zip(("q", "k", "v", "sinks"), got, want):
        assert torch.isfinite(a).all(), name
        if name == "sinks":
            a, b = a[finite], b[finite]
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=0)
