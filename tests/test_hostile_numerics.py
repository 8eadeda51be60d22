"""Hostile values where the math is finite: a masked key's NaN or inf value never reaches a row that does not
keep it (forward, backward, split-KV decoding), and relu_attention neither divides by zero for an empty
sequence nor overflows float16 where its result fits. Each case is checked against an independent float64
computation that visits only the keys each row keeps."""

import math

import pytest
import torch

import attnfuse as af


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def window(q, k, v):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 5)) @ v


@af.attention
def relu(q, k, v):
    return af.relu_attention(af.causal(af.scaled_dot_product(q, k))) @ v


def kept_keys_only(q, k, v, kept, normaliser="softmax", kv_lens=None):
    """float64 attention row by row over the keys ``kept(position, key)`` allows; bottom-right aligned.
    q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV) -> (B, Hq, Nq, DV). Differentiable."""
    B, Hq, Nq, D = q.shape
    group = Hq // k.shape[1]
    rows = []
    for b in range(B):
        n_keys = k.shape[2] if kv_lens is None else int(kv_lens[b])
        for h in range(Hq):
            for i in range(Nq):
                keys = [j for j in range(n_keys) if kept(i + n_keys - Nq, j)]
                if not keys:
                    rows.append(q.new_zeros(v.shape[-1]))
                    continue
                s = k[b, h // group, keys] @ q[b, h, i] / math.sqrt(D)
                w = torch.softmax(s, 0) if normaliser == "softmax" else torch.relu(s) / n_keys
                rows.append(w @ v[b, h // group, keys])
    return torch.stack(rows).reshape(B, Hq, Nq, -1)


def _qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float64):
    return (
        torch.randn(B, Hq, Nq, D, dtype=dtype),
        torch.randn(B, Hkv, Nk, D, dtype=dtype),
        torch.randn(B, Hkv, Nk, D, dtype=dtype),
    )


def _same(out, expected, atol):
    """Equal non-finite patterns; the finite entries within ``atol``."""
    assert torch.equal(torch.isfinite(out), torch.isfinite(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(out[finite].double(), expected[finite].double(), atol=atol, rtol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_masked_non_finite_value_does_not_reach_rows_that_mask_it(bad):
    """A masked NaN or inf in v reaches no row that masks it: v[0, 0, 20] with causal and N 24 (rows 0-19)."""
    q, k, v = _qkv(1, 2, 2, 24, 24, 16, torch.float32)
    v[0, 0, 20] = bad
    out = causal(q, k, v)
    expected = kept_keys_only(q.double(), k.double(), v.double(), lambda i, j: j <= i)
    _same(out, expected, atol=1e-5)
    assert torch.isfinite(out[0, 0, :20]).all() and not torch.isfinite(out[0, 0, 20:]).any()


def test_opposite_infinities_in_one_column_and_overflowing_sums_are_handled_exactly():
    """+inf and -inf in one column of a masked tile, and large finite float16 values whose sum overflows,
    give the math's result."""
    q, k, v = _qkv(1, 2, 2, 24, 24, 16, torch.float16)
    v[0, 0, 20, 2], v[0, 0, 22, 2] = float("inf"), float("-inf")
    v[0, 1, :, 5] = 6.0e4  # 24 x 6e4 overflows float16 (and sums past any one value)
    out = causal(q, k, v)
    expected = kept_keys_only(q.double(), k.double(), v.double(), lambda i, j: j <= i)
    _same(out, expected, atol=2e-2)  # float16 rounding; column 5 is exactly 6e4 in every row
    assert torch.isfinite(out[0, 0, :20]).all() and torch.isfinite(out[0, 1]).all()


def test_backward_with_a_masked_nan_value_matches_the_math():
    """dV stays finite (it does not depend on V); dQ, dK are NaN exactly where a kept value's NaN reaches."""
    q, k, v = _qkv(1, 2, 1, 40, 40, 16)
    v[0, 0, 30, 3] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = causal(*leaves)
    dout = torch.randn_like(out)
    out.backward(dout)
    oracle = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = kept_keys_only(*oracle, lambda i, j: j <= i)
    expected.backward(dout)
    _same(out, expected, atol=1e-10)
    for got, want in zip(leaves, oracle):
        _same(got.grad, want.grad, atol=1e-10)
    assert torch.isfinite(leaves[2].grad).all() and torch.isfinite(leaves[0].grad[0, :, :30]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_split_kv_decoding_through_a_window_skips_a_masked_non_finite_value(bad):
    q, k, v = _qkv(2, 4, 2, 3, 48, 16, torch.float32)
    kv_lens = torch.tensor([48, 33], dtype=torch.int32)
    v[0, 1, 35] = bad  # sequence 0's queries sit at 45..47 and keep keys 40..47: a visited tile, masked key
    v[1, 0, 24] = bad  # sequence 1's queries sit at 30..32 and keep 25..32
    v[1, 1, 31] = bad  # kept by the queries at 31 and 32
    out = window(q, k, v, kv_lens=kv_lens)
    expected = kept_keys_only(q.double(), k.double(), v.double(), lambda i, j: i - 5 <= j <= i, kv_lens=kv_lens)
    _same(out, expected, atol=1e-5)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :, 0]).all()
    assert not torch.isfinite(out[1, 2:, 1:]).any()  # heads 2, 3 read kv head 1


def test_relu_attention_with_an_empty_sequence_has_zero_gradients():
    """kv_lens 0 made v.grad all NaN (0 · (1/0)); the sequence has no keys, so every gradient is 0."""
    q, k, v = _qkv(2, 2, 2, 8, 8, 16)
    kv_lens = torch.tensor([0, 8], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = relu(*leaves, kv_lens=kv_lens)
    dout = torch.randn_like(out)
    out.backward(dout)
    oracle = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = kept_keys_only(*oracle, lambda i, j: j <= i, normaliser="relu", kv_lens=kv_lens)
    expected.backward(dout)
    _same(out, expected, atol=1e-10)
    for got, want in zip(leaves, oracle):
        _same(got.grad, want.grad, atol=1e-10)
    assert not leaves[2].grad[0].any()


def test_relu_attention_float16_weights_do_not_overflow():
    """Scores near 2e6 give weights above float16's largest value (65504) although the output fits."""
    q = torch.full((1, 1, 16, 16), 700.0) * (1 + 0.01 * torch.rand(1, 1, 16, 16))
    k = torch.full((1, 1, 16, 16), 700.0) * (1 + 0.01 * torch.rand(1, 1, 16, 16))
    v = 1e-3 * torch.rand(1, 1, 16, 16)
    q, k, v = q.half(), k.half(), v.half()
    out = relu(q, k, v)
    expected = kept_keys_only(q.double(), k.double(), v.double(), lambda i, j: j <= i, normaliser="relu")
    assert expected.abs().max() > 10 and expected.abs().max() < 6e4
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=5e-3, atol=0)


@af.attention
def causal_bias(q, k, v, bias):
    return af.softmax(af.causal(af.additive_bias(af.scaled_dot_product(q, k), bias))) @ v


def test_bias_gradient_of_pairs_that_mask_a_nan_value_is_zero():
    """A masked key's NaN value never reaches the score-shaped gradient of a bias: masked pairs get 0, as in
    the float64 reference, also in rows that keep the key (whose kept pairs get the math's NaN)."""
    torch.manual_seed(5)
    q, k, v = _qkv(1, 2, 2, 24, 24, 16)
    v[0, 1, 17, 4] = float("nan")
    bias = torch.randn(1, 2, 24, 24, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = causal_bias(*leaves)
    dout = torch.randn_like(out)
    out.backward(dout)
    oracle = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    causal_bias.reference(*oracle).backward(dout)
    _same(leaves[3].grad, oracle[3].grad, atol=1e-10)
    grad = leaves[3].grad[0, 1]
    kept = torch.ones(24, 24, dtype=torch.bool).tril()
    assert torch.isfinite(grad[:17]).all() and torch.isfinite(grad[~kept]).all()
    assert not torch.isfinite(grad[17:][kept[17:]]).any()
