"""qk_norm: RMSNorm of q and k rows (Qwen3, Gemma 3), a built-in qk transform.

Forward and q/k gradients against the float64 reference evaluator (and, once, against torch's own
``rms_norm`` and SDPA), with and without weights, before rope, with GQA, decoding with kv_lens, in the fused
kernels and hoisted into transform passes; bad weights and eps refused. The weights' gradients:
tests/test_qk_norm_grads.py.
"""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse.runtime import hoisted
from attnfuse.testing import assert_matches_reference

from conftest import hoisted_last_call, plan_setting


@af.attention
def normed(q, k, v, wq, wk):
    s = af.scaled_dot_product(*af.qk_norm(q, k, wq, wk, eps=1e-5))
    return af.softmax(af.causal(s)) @ v


@af.attention
def qwen3(q, k, v, wq, wk):
    """Qwen3: q/k RMSNorm, then RoPE (theta), causal softmax."""
    q, k = af.qk_norm(q, k, wq, wk)
    return af.softmax(af.causal(af.rope(q, k, theta=500.0))) @ v


@af.attention
def qwen3_tables(q, k, v, wq, wk, cos, sin):
    q, k = af.qk_norm(q, k, weight_q=wq, weight_k=wk)
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


PROGRAMS = {"normed": normed, "qwen3": qwen3}
# B, Hq, Hkv, Nq, Nk, D: GQA off the interpreter's 32-row tiles; MHA on them; MQA with D=32.
SHAPES = [(2, 4, 2, 20, 37, 16), (1, 2, 2, 64, 64, 16), (1, 4, 1, 33, 40, 32)]
WEIGHTS = ["both", "q only", "none"]


def _qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32, grad=False):
    q = torch.randn(B, Hq, Nq, D) * 3  # rows of RMS far from 1, so that normalising matters
    k, v = torch.randn(B, Hkv, Nk, D) * 0.3, torch.randn(B, Hkv, Nk, D)
    return tuple(t.to(dtype).requires_grad_(grad) for t in (q, k, v))


def _weights(which: str, D: int):
    wq = torch.rand(D) * 2 - 0.5 if which != "none" else None  # some negative, like trained weights
    wk = torch.rand(D) * 2 - 0.5 if which == "both" else None
    return wq, wk


def _check_forward(program, q, k, v, *extra, **call):
    got = program(q, k, v, *extra, **call)
    ref64 = program.reference(q, k, v, *extra, **call)
    assert_matches_reference(got, ref64, program.reference(q, k, v, *extra, dtype=q.dtype, **call))


def _check_grads(program, q, k, v, *extra):
    out = program(q, k, v, *extra)
    dout = torch.randn(out.shape).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want64 = torch.autograd.grad(program.reference(q, k, v, *extra), (q, k, v), dout.double())
    want_lowp = torch.autograd.grad(program.reference(q, k, v, *extra, dtype=q.dtype), (q, k, v), dout)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want64, want_lowp):
        assert_matches_reference(a, b, c, q.dtype, what=name)


@pytest.mark.parametrize("which", WEIGHTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*s))
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_forward_and_gradients_match_reference(name, shape, which):
    q, k, v = _qkv(*shape, grad=True)
    _check_grads(PROGRAMS[name], q, k, v, *_weights(which, shape[-1]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_forward_in_other_dtypes(dtype):
    q, k, v = _qkv(1, 2, 1, 24, 40, 16, dtype)
    wq, wk = (w.to(dtype) for w in _weights("both", 16))
    _check_forward(qwen3, q, k, v, wq, wk)


def test_matches_torch_rms_norm_and_sdpa():
    """An independent reference: torch's rms_norm on q and k, then SDPA."""
    q, k, v = _qkv(2, 2, 2, 24, 24, 32)
    wq, wk = _weights("both", 32)
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.nn.functional.rms_norm(q, (32,), wq, eps=1e-5),
        torch.nn.functional.rms_norm(k, (32,), wk, eps=1e-5),
        v,
        is_causal=True,
    )
    torch.testing.assert_close(normed(q, k, v, wq, wk), want, atol=2e-5, rtol=2e-5)


def test_before_rope_tables():
    """The norm runs before rope's rotation: with given cos/sin tables, the gradients too."""
    q, k, v = _qkv(2, 4, 2, 30, 40, 16, grad=True)
    angles = torch.randn(2, 40, 8) * 3
    angles = torch.cat((angles, angles), dim=-1)
    _check_grads(qwen3_tables, q, k, v, *_weights("both", 16), angles.cos(), angles.sin())


def test_decoding_with_kv_lens():
    """A few queries against a cache with per-sequence lengths (the split-KV decoding kernel)."""
    q, k, v = _qkv(3, 4, 2, 2, 48, 16)
    kv_lens = torch.tensor([48, 17, 2], dtype=torch.int32)
    _check_forward(qwen3, q, k, v, *_weights("both", 16), kv_lens=kv_lens)


def test_chunk_positions_and_strided_weights():
    """A chunk placed by q_offset/k_offset (the norm reads no position), weights that are strided views."""
    q, k, v = _qkv(1, 2, 1, 12, 20, 16)
    wq, wk = torch.randn(32)[::2], torch.randn(16, 3)[:, 1]
    assert wq.stride() == (2,) and wk.stride() == (3,)
    _check_forward(qwen3, q, k, v, wq, wk, q_offset=30, k_offset=22, seq_len=64)


@pytest.mark.parametrize("which", ["both", "none"])
def test_hoisted_and_fused_agree_with_reference(which):
    """Hoisted into transform passes (and a gradient pass) or run inside the kernels: both match."""
    q, k, v = _qkv(1, 4, 2, 64, 70, 16, grad=True)
    weights = _weights(which, 16)
    assert "qk transform of k" in qwen3.source(q, k, v, *weights, kernel="transform")
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 1):
        _check_grads(qwen3, q, k, v, *weights)
        assert hoisted_last_call()
        hoisted_out = qwen3(q, k, v, *weights)
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 10**9):
        _check_grads(qwen3, q, k, v, *weights)
        assert not hoisted_last_call()
        torch.testing.assert_close(qwen3(q, k, v, *weights), hoisted_out)


@pytest.mark.parametrize(
    "weight, match",
    [
        (torch.randn(17), r"weight_k must have shape \(D,\) = \(16,\), got \(17,\)"),
        (torch.randn(2, 16), r"weight_k must have shape \(D,\) = \(16,\), got \(2, 16\)"),
        (torch.ones(16, dtype=torch.int32), r"weight_k must be a float tensor .* got torch.int32"),
        (torch.randn(16, device="meta"), "weight_k is on meta, the inputs on cpu"),
    ],
    ids=["length", "rank", "dtype", "device"],
)
@pytest.mark.parametrize("run", ["call", "reference"])
def test_bad_weight_is_refused(weight, match, run):
    q, k, v = _qkv(1, 2, 1, 8, 8, 16)
    call = normed if run == "call" else normed.reference
    with pytest.raises(af.InputError, match=f"qk_norm: {match}"):
        call(q, k, v, torch.randn(16), weight)


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan"), float("inf")])
def test_bad_eps_is_refused(eps):
    @af.attention
    def program(q, k, v):
        return af.softmax(af.scaled_dot_product(*af.qk_norm(q, k, eps=eps))) @ v

    with pytest.raises(af.ProgramError, match="qk_norm: parameter 'eps': must be a finite number > 0"):
        program(*_qkv(1, 1, 1, 8, 8, 16))
