"""Gradients of qk transforms' (D,) tensors: qk_norm's weights, and a third party's transform declaring one.

Every gradient (q, k, v and the weights) against the float64 reference evaluator through torch.autograd: q-only,
k-only and both weights, GQA and MQA, with rope after the norm, fused into the backward kernels and hoisted into
a gradient pass, with kv_lens, packed sequences, in float16 (the gradient in the weight's dtype), and one tensor
serving both sides.
"""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse.combinator import Combinator, Param, QKTransformFragment, Role, TensorArg
from attnfuse.runtime import hoisted
from attnfuse.plugin import random_tensor
from attnfuse.testing import assert_matches_reference, check_combinator

from conftest import hoisted_last_call, last_call, plan_setting


@af.attention
def normed(q, k, v, wq, wk):
    s = af.scaled_dot_product(*af.qk_norm(q, k, wq, wk, eps=1e-5))
    return af.softmax(af.causal(s)) @ v


@af.attention
def qwen3(q, k, v, wq, wk):
    """Qwen3: q/k RMSNorm, then RoPE (theta), causal softmax."""
    return af.softmax(af.causal(af.rope(*af.qk_norm(q, k, wq, wk), theta=500.0))) @ v


@af.attention
def gemma3_tables(q, k, v, wq, wk, cos, sin):
    """The norm, then rope from cos/sin tables (an HF model's position embeddings), a sliding window."""
    s = af.rope(*af.qk_norm(q, k, weight_q=wq, weight_k=wk), cos=cos, sin=sin)
    return af.softmax(af.sliding_window(s, left=24, right=0)) @ v


PROGRAMS = {"normed": normed, "qwen3": qwen3, "gemma3_tables": gemma3_tables}
# B, Hq, Hkv, Nq, Nk, D: GQA off the interpreter's 32-row tiles; MQA with D=32.
SHAPES = [(2, 4, 2, 20, 37, 16), (1, 4, 1, 33, 40, 32)]
WEIGHTS = ["both", "q only", "k only"]


def _qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32):
    q = torch.randn(B, Hq, Nq, D) * 3  # rows of RMS far from 1, so that normalising matters
    k, v = torch.randn(B, Hkv, Nk, D) * 0.3, torch.randn(B, Hkv, Nk, D)
    return tuple(t.to(dtype).requires_grad_() for t in (q, k, v))


def _weights(which: str, D: int, dtype=torch.float32):
    """(wq, wk): random (D,) weights, some negative as trained ones are, requiring grad; None for a side left out."""
    return tuple(
        (torch.rand(D) * 2 - 0.5).to(dtype).requires_grad_() if which in ("both", f"{side} only") else None
        for side in "qk"
    )


def _tables(B, Nk, D):
    angles = torch.randn(B, Nk, D // 2) * 3
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _check_grads(program, q, k, v, wq, wk, *extra, dout=None, **call):
    """Every gradient of the call (q, k, v and each weight requiring grad) against the float64 reference's;
    ``dout``: the output's gradient (random if not given)."""
    leaves = [t for t in (q, k, v, wq, wk) if t is not None and t.requires_grad]
    names = ["dq", "dk", "dv"] + [n for n, w in (("dwq", wq), ("dwk", wk)) if w is not None and w.requires_grad]
    out = program(q, k, v, wq, wk, *extra, **call)
    dout = torch.randn(out.shape).to(out.dtype) if dout is None else dout
    got = torch.autograd.grad(out, leaves, dout)
    want64 = torch.autograd.grad(program.reference(q, k, v, wq, wk, *extra, **call), leaves, dout.double())
    want_lowp = torch.autograd.grad(program.reference(q, k, v, wq, wk, *extra, dtype=q.dtype, **call), leaves, dout)
    rows = {"dwq": q.shape[0] * q.shape[1] * q.shape[2], "dwk": k.shape[0] * k.shape[1] * k.shape[2]}
    for name, leaf, a, b, c in zip(names, leaves, got, want64, want_lowp):
        assert a.dtype == leaf.dtype, f"{name}: dtype {a.dtype}, its input's {leaf.dtype}"
        assert_matches_reference(a, b, c, q.dtype, what=name, summed=rows.get(name, 1))
    return got


@pytest.mark.parametrize("which", WEIGHTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*s))
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_weight_gradients_match_reference(name, shape, which):
    q, k, v = _qkv(*shape)
    extra = _tables(shape[0], shape[4], shape[5]) if name == "gemma3_tables" else ()
    _check_grads(PROGRAMS[name], q, k, v, *_weights(which, shape[-1]), *extra)


@pytest.mark.parametrize("which", ["both", "k only"])
def test_hoisted_and_fused_weight_gradients(which):
    """Hoisted (a gradient pass writes the weights' partial sums) or fused (the dQ and dK/dV kernels): both
    match the reference, and each other."""
    q, k, v = _qkv(1, 4, 2, 64, 70, 16)
    weights = _weights(which, 16)
    dout = torch.randn(1, 4, 64, 16)
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 1):
        hoisted_grads = _check_grads(qwen3, q, k, v, *weights, dout=dout)
        assert hoisted_last_call()
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 10**9):
        fused_grads = _check_grads(qwen3, q, k, v, *weights, dout=dout)
        assert not hoisted_last_call()
    for a, b in zip(hoisted_grads, fused_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", [dict(interleaved=True), dict(rotary_dim=8), dict(rotary_dim=8, interleaved=True)])
@pytest.mark.parametrize("hoist", [1, 10**9], ids=["hoisted", "fused"])
def test_weight_gradients_under_a_column_map(rope, hoist):
    """With interleaved or partial rope after the norm, the halves hold other columns (the program's column map):
    each weight's gradient lands at its own columns, fused and hoisted."""

    @af.attention
    def mapped(q, k, v, wq, wk):
        return af.softmax(af.causal(af.rope(*af.qk_norm(q, k, wq, wk), **rope))) @ v

    q, k, v = _qkv(1, 4, 2, 64, 70, 16)
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", hoist):
        _check_grads(mapped, q, k, v, *_weights("both", 16))
        assert hoisted_last_call() == (hoist == 1)


def test_with_kv_lens():
    """Keys past a sequence's length give its k weight nothing, as in the reference."""
    q, k, v = _qkv(3, 4, 2, 6, 48, 16)
    kv_lens = torch.tensor([48, 17, 5], dtype=torch.int32)
    _check_grads(normed, q, k, v, *_weights("both", 16), kv_lens=kv_lens)


def test_packed_sequences():
    """Documents packed in one row (cu_seqlens), across tile boundaries: each weight's gradient sums every
    document's rows, as the reference run on each document alone gives."""
    lengths = [20, 37, 7]
    q, k, v = _qkv(1, 4, 2, sum(lengths), sum(lengths), 16)
    wq, wk = _weights("both", 16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = qwen3(q, k, v, wq, wk, cu_seqlens_q=cu, cu_seqlens_k=cu)
    dout = torch.randn(out.shape)
    leaves = (q, k, v, wq, wk)
    got = torch.autograd.grad(out, leaves, dout)
    documents = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def reference(dtype):
        rows = [qwen3.reference(*(t[:, :, a:b] for t in (q, k, v)), wq, wk, dtype=dtype) for a, b in documents]
        return torch.autograd.grad(torch.cat(rows, 2), leaves, dout.to(dtype))

    summed = {"dwq": 4 * sum(lengths), "dwk": 2 * sum(lengths)}
    for name, a, b, c in zip(("dq", "dk", "dv", "dwq", "dwk"), got, reference(torch.float64), reference(torch.float32)):
        assert_matches_reference(a, b, c, what=name, summed=summed.get(name, 1))


def test_half_precision_weights():
    """float16 inputs and weights: each weight's gradient in float16, within float16's tolerance."""
    q, k, v = _qkv(2, 2, 1, 24, 40, 16, torch.float16)
    _check_grads(qwen3, q, k, v, *_weights("both", 16, torch.float16))


def test_float32_weights_of_half_precision_rows():
    """Weights of another dtype than the rows (float32 weights, float16 rows): the gradient in the weight's."""
    q, k, v = _qkv(1, 2, 2, 24, 24, 16, torch.float16)
    _check_grads(normed, q, k, v, *_weights("both", 16))


def test_one_weight_for_both_sides():
    """One tensor as both weights: its gradient sums both sides' (dQ kernel's and dK/dV kernel's)."""
    q, k, v = _qkv(2, 4, 2, 20, 37, 16)
    w = (torch.rand(16) * 2 - 0.5).requires_grad_()

    @af.attention
    def shared(q, k, v, w):
        return af.softmax(af.causal(af.scaled_dot_product(*af.qk_norm(q, k, w, w)))) @ v

    out = shared(q, k, v, w)
    dout = torch.randn(out.shape)
    [got] = torch.autograd.grad(out, [w], dout)
    [want64] = torch.autograd.grad(shared.reference(q, k, v, w), [w], dout.double())
    [want32] = torch.autograd.grad(shared.reference(q, k, v, w, dtype=torch.float32), [w], dout)
    assert_matches_reference(got, want64, want32, what="dw", summed=2 * 20 * 4 + 2 * 37 * 2)


def test_detached_weights_generate_the_plain_kernels():
    """Weights that need no gradient leave the backward kernels as they are; one that does adds its sums."""
    q, k, v = (t.detach() for t in _qkv(1, 2, 1, 16, 16, 16))
    w = torch.randn(16)
    plain = [qwen3.source(q, k, v, w, w, kernel=kind) for kind in ("dq", "dkdv")]
    assert not any("part_row" in source for source in plain)
    q, k, v = _qkv(1, 2, 1, 16, 16, 16)
    qwen3(q, k, v, w.requires_grad_(), w.detach()).sum().backward()
    kernels = last_call().backward
    assert "part_row" in kernels.dq.source and "part_row" not in kernels.dkdv.source
    assert kernels.dkdv.source == plain[1]


# ---------------------------------------------------------------------------------------------------------
# The contract: a third party's qk transform declaring a (D,) tensor's gradient.


def _column_scale_reference(q, k, ctx, scale):
    """q, k (..., D) -> q · scale, k · scale (scale: (D,))."""
    return q * scale.to(q.dtype), k * scale.to(k.dtype)


def _column_scale_examples(draw, shape):
    return {"scale": random_tensor(draw, shape.D) * 0.5 + 1}


_SCALE = "".join(
    f"${{tmp}}_c{i} = tl.load($scale + ({column}) * $scale_s0, mask=dh < HALF, other=0.0).to($acc_dtype)[None, :]\n"
    for i, column in ((1, "dh"), (2, "dh + HALF"))
)
_APPLY = _SCALE + "$x1 = $x1 * ${tmp}_c1\n$x2 = $x2 * ${tmp}_c2\n"
_GRAD = _SCALE + "$g1 = $g1 * ${tmp}_c1\n$g2 = $g2 * ${tmp}_c2\n"
_SCALE_GRAD = "$d1 = $g1 * $x1\n$d2 = $g2 * $x2\n"

COLUMN_SCALE = Combinator(
    name="_test_column_scale",
    role=Role.QK_TRANSFORM,
    doc="q and k times one (D,) scale per column.",
    params=[Param(name="scale", runtime=True, doc="(D,) float scale of the columns")],
    reference=_column_scale_reference,
    tensors=[TensorArg(name="scale", rank=1)],
    prepare=lambda ctx, scale: {"scale": scale},
    examples=_column_scale_examples,
    fragment=QKTransformFragment(
        q=_APPLY,
        k=_APPLY,
        q_grad=_GRAD,
        k_grad=_GRAD,
        q_tensor_grads=[("scale", _SCALE_GRAD)],
        k_tensor_grads=[("scale", _SCALE_GRAD)],
    ),
)


class _Plugin:
    @af.hookimpl
    def attnfuse_combinators(self):
        return [COLUMN_SCALE]


@pytest.fixture(scope="module")
def column_scale():
    af.register_plugin(_Plugin(), name="test-column-scale")
    try:

        @af.attention
        def program(q, k, v, scale):
            return af.softmax(af.causal(af.scaled_dot_product(*af._test_column_scale(q, k, scale)))) @ v

        yield program
    finally:
        af.unregister_plugin("test-column-scale")


def test_third_party_tensor_gradient(column_scale):
    q, k, v = _qkv(2, 4, 2, 20, 37, 16)
    scale = (torch.rand(16) + 0.5).requires_grad_()
    out = column_scale(q, k, v, scale)
    dout = torch.randn(out.shape)
    got = torch.autograd.grad(out, (q, k, v, scale), dout)
    want64 = torch.autograd.grad(column_scale.reference(q, k, v, scale), (q, k, v, scale), dout.double())
    want32 = torch.autograd.grad(column_scale.reference(q, k, v, scale, dtype=torch.float32), (q, k, v, scale), dout)
    for name, a, b, c, n in zip(("dq", "dk", "dv", "dscale"), got, want64, want32, (1, 1, 1, 2 * 4 * 20 + 2 * 2 * 37)):
        assert_matches_reference(a, b, c, what=name, summed=n)


def test_third_party_tensor_of_other_shape_is_refused(column_scale):
    """A transform tensor's gradient is one value per column: a tensor of another shape requiring grad is refused
    before anything runs, naming it and the shape allowed."""
    q, k, v = _qkv(1, 2, 1, 8, 8, 16)
    scale = torch.rand(32).requires_grad_()
    with pytest.raises(af.InputError, match=r"'scale' \(argument 'scale'\) requires grad .* shape \(D,\) = \(16,\)"):
        column_scale(q, k, v, scale)


def test_third_party_conforms(column_scale):
    """The conformance kit draws the transform's scale requiring grad and checks its gradient too."""
    check_combinator("_test_column_scale", max_examples=3, head_dims=(16,))


def test_torch_compile_fullgraph_equals_eager():
    """Under torch.compile (the program one opaque op), the weights get the eager call's gradients."""
    q, k, v = _qkv(1, 4, 2, 24, 24, 16)
    wq, wk = _weights("both", 16)
    compiled = torch.compile(qwen3, backend="aot_eager", fullgraph=True)
    dout = torch.randn(1, 4, 24, 16)
    leaves = (q, k, v, wq, wk)
    got = torch.autograd.grad(compiled(q, k, v, wq, wk), leaves, dout)
    want = torch.autograd.grad(qwen3(q, k, v, wq, wk), leaves, dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
