"""Gradients are right or refused, never silently wrong.

1. A tensor the backward reads (a bias, rope's cos/sin tables, a BlockMask's tensors, kv_lens, a third-party
   plugin's tensor) edited in place between forward and backward: torch's in-place error, eager and compiled.
2. Double backward (a gradient taken with create_graph=True, differentiated again): ``af.UnsupportedError``,
   whether or not the upstream gradient is constant; first-order gradients under create_graph=True still work.
3. A gradient-carrying plugin tensor whose shape does not broadcast to the scores: refused at the call.
"""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse.combinator import Combinator, Param, Role, ScoreModFragment, TensorArg
from attnfuse.errors import InputError
from attnfuse.testing import assert_matches_reference, random_tensor

B, HQ, HKV, N, D = 1, 4, 2, 24, 16
IN_PLACE = "modified by an inplace operation"


# A third-party score modification with a per-head tensor and its gradient: s + w[h].


def _head_weights(w, Hq: int) -> torch.Tensor:
    """w as (Hq,); the plugin accepts (Hq,), (Hq, 1, 1) and (1, Hq, 1, 1)."""
    if (
        not isinstance(w, torch.Tensor)
        or not w.is_floating_point()
        or tuple(w.shape) not in ((Hq,), (Hq, 1, 1), (1, Hq, 1, 1))
    ):
        raise InputError(
            f"_test_head_bias: w must be a float tensor (Hq,), (Hq, 1, 1) or (1, Hq, 1, 1) with "
            f"Hq = {Hq}, got {getattr(w, 'shape', type(w).__name__)}"
        )
    return w.reshape(Hq)


HEAD_BIAS = Combinator(
    name="_test_head_bias",
    role=Role.SCORE_MOD,
    doc="s + w[h]: one learned bias per query head.",
    params=[Param(name="w", runtime=True, doc="float tensor, one value per query head")],
    reference=lambda s, ctx, w: s + _head_weights(w, ctx.Hq).view(1, ctx.Hq, 1, 1),
    tensors=[TensorArg(name="w", rank=1)],
    prepare=lambda ctx, w: {"w": _head_weights(w, ctx.Hq)},
    fragment=ScoreModFragment(
        prologue="${self}_bias = tl.load($w + h * $w_s0).to($acc_dtype)",
        body="s = s + ${self}_bias",
        grad="",
        tensor_grads=[("w", "ds")],
    ),
    examples=lambda draw, shape: {"w": random_tensor(draw, shape.Hq, 1, 1)},
)


class _Plugin:
    @af.hookimpl
    def attnfuse_combinators(self):
        return [HEAD_BIAS]


@pytest.fixture(scope="module", autouse=True)
def head_bias_plugin():
    af.register_plugin(_Plugin(), name="autograd-trust-test:_test_head_bias")
    try:
        yield
    finally:
        af.unregister_plugin("autograd-trust-test:_test_head_bias")


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v


@af.attention
def rope_tables(q, k, v, cos, sin):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def head_bias(q, k, v, w):
    return af.softmax(af._test_head_bias(af.causal(af.scaled_dot_product(q, k)), w)) @ v


def _qkv(dtype=torch.float32, Nq=N):
    return tuple(
        torch.randn(*shape, dtype=dtype).requires_grad_(True)
        for shape in ((B, HQ, Nq, D), (B, HKV, N, D), (B, HKV, N, D))
    )


def _tables():
    angles = torch.randn(N, D // 2) * 3
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _case(name: str):
    """(program, args, kwargs, leaves, edit): a differentiable call, the tensors it differentiates, and an
    in-place edit of one tensor its backward reads."""
    q, k, v = _qkv()
    if name == "bias":
        bias = torch.randn(HQ, N, N, requires_grad=True)
        return biased, (q, k, v, bias), {}, (q, k, v, bias), lambda: bias.mul_(5)
    if name == "bias-detached":
        bias = torch.randn(1, HQ, 1, N)
        return biased, (q, k, v, bias), {}, (q, k, v), lambda: bias.mul_(5)
    if name in ("rope-cos", "rope-sin"):
        cos, sin = _tables()
        table = cos if name == "rope-cos" else sin
        return rope_tables, (q, k, v, cos, sin), {}, (q, k, v), lambda: table.mul_(-1)
    if name == "block-mask":
        mask = af.create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, N, N, block_size=16)
        return sparse, (q, k, v, mask), {}, (q, k, v), lambda: mask.kv_num_blocks.zero_()
    if name.startswith("kv-lens"):
        lens = torch.tensor([18], dtype=torch.int32 if name == "kv-lens-int32" else torch.int64)
        return causal, (q, k, v), {"kv_lens": lens}, (q, k, v), lambda: lens.add_(3)
    if name == "third-party":
        w = torch.randn(HQ, 1, 1, requires_grad=True)
        return head_bias, (q, k, v, w), {}, (q, k, v, w), lambda: w.mul_(3)
    raise AssertionError(name)


CASES = ["bias", "bias-detached", "rope-cos", "rope-sin", "block-mask", "kv-lens-int32", "kv-lens-int64", "third-party"]


def _assert_grads_match_reference(program, args, kwargs, leaves, got, dout):
    """``got`` equals float64 autograd through ``program.reference`` (within float32's own error)."""
    want64 = torch.autograd.grad(program.reference(*args, **kwargs), leaves, dout.double())
    want32 = torch.autograd.grad(program.reference(*args, dtype=torch.float32, **kwargs), leaves, dout)
    for what, a, b, c in zip(("dq", "dk", "dv", "dextra"), got, want64, want32):
        summed = dout.numel() // D * N // b.numel() if what == "dextra" else 1
        assert_matches_reference(a, b, c, torch.float32, what=what, summed=summed)


# 1. In-place edits between forward and backward ------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_in_place_edit_before_backward_raises(case):
    program, args, kwargs, leaves, edit = _case(case)
    out = program(*args, **kwargs)
    with torch.no_grad():
        edit()
    with pytest.raises(RuntimeError, match=IN_PLACE):
        torch.autograd.grad(out, leaves, torch.randn_like(out))


@pytest.mark.parametrize("case", CASES)
def test_gradients_without_edit_match_reference(case):
    program, args, kwargs, leaves, _ = _case(case)
    out = program(*args, **kwargs)
    dout = torch.randn_like(out)
    _assert_grads_match_reference(program, args, kwargs, leaves, torch.autograd.grad(out, leaves, dout), dout)


COMPILED_CASES = ["bias", "rope-cos", "kv-lens-int32", "kv-lens-int64", "third-party"]


def _compiled(case: str, backend: str = "aot_eager"):
    program, args, kwargs, leaves, edit = _case(case)
    out = torch.compile(lambda *args: program(*args, **kwargs), backend=backend, fullgraph=True)(*args)
    return program, args, kwargs, leaves, edit, out


@pytest.mark.parametrize(
    "case,backend", [(c, "aot_eager") for c in COMPILED_CASES] + [("bias", "inductor"), ("kv-lens-int32", "inductor")]
)
def test_compiled_in_place_edit_before_backward_raises(case, backend):
    _, _, _, leaves, edit, out = _compiled(case, backend)
    with torch.no_grad():
        edit()
    with pytest.raises(RuntimeError, match=IN_PLACE):
        torch.autograd.grad(out, leaves, torch.randn_like(out))


@pytest.mark.parametrize("case", COMPILED_CASES)
def test_compiled_gradients_without_edit_match_reference(case):
    program, args, kwargs, leaves, _, out = _compiled(case)
    dout = torch.randn_like(out)
    _assert_grads_match_reference(program, args, kwargs, leaves, torch.autograd.grad(out, leaves, dout), dout)


def test_paged_cache_takes_no_gradient():
    """A block_table never reaches a backward to be edited before: a call wanting gradients is refused."""
    q = torch.randn(B, HQ, 1, D, requires_grad=True)
    pool_k, pool_v = torch.randn(4, 16, HKV, D), torch.randn(4, 16, HKV, D)
    table, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(InputError, match="gradients through a paged cache are not supported"):
        causal(q, pool_k, pool_v, kv_lens=lens, block_table=table)


# 2. Double backward ----------------------------------------------------------------------------------------


def _penalised(how: str):
    """q, k, v, bias (all requiring grad) and the program call, eager or through the op's autograd formula
    (torch.compile with the eager backend: Dynamo's graph runs the op under plain autograd)."""
    q, k, v = _qkv()
    bias = torch.randn(HQ, N, N, requires_grad=True)
    call = (
        (lambda *a: biased(*a))
        if how == "eager"
        else torch.compile(lambda *a: biased(*a), backend="eager", fullgraph=True)
    )
    return (q, k, v, bias), call


UPSTREAM = {"pow": lambda out: out.pow(2).sum(), "sum": lambda out: out.sum()}  # "sum": a constant dL/dout


@pytest.mark.parametrize("how", ["eager", "op"])
@pytest.mark.parametrize("upstream", sorted(UPSTREAM))
@pytest.mark.parametrize("wrt", ["v", "bias", "all"])
def test_double_backward_raises(how, upstream, wrt):
    (q, k, v, bias), call = _penalised(how)
    loss = UPSTREAM[upstream](call(q, k, v, bias))
    (gq,) = torch.autograd.grad(loss, q, create_graph=True)
    penalised = loss + gq.pow(2).sum()
    with pytest.raises(af.UnsupportedError, match="double backward through an attnfuse program is not supported"):
        if wrt == "all":
            penalised.backward()
        else:
            torch.autograd.grad(penalised, v if wrt == "v" else bias)


@pytest.mark.parametrize("upstream", sorted(UPSTREAM))
def test_double_backward_under_aot_autograd_raises(upstream):
    """Under AOT autograd (every torch.compile backend but "eager") torch refuses a compiled graph's double
    backward itself, with its own RuntimeError, before the op's autograd formula could."""
    q, k, v = _qkv()
    bias = torch.randn(HQ, N, N, requires_grad=True)
    loss = UPSTREAM[upstream](torch.compile(lambda *a: biased(*a), backend="aot_eager", fullgraph=True)(q, k, v, bias))
    (gq,) = torch.autograd.grad(loss, q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss + gq.pow(2).sum(), (v, bias))


@pytest.mark.parametrize("how", ["eager", "op"])
def test_first_order_gradients_under_create_graph_match_reference(how):
    (q, k, v, bias), call = _penalised(how)
    leaves = (q, k, v, bias)
    out = call(*leaves)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout, create_graph=True)
    assert all(g.requires_grad for g in got)  # connected, so a second derivative raises rather than vanishes
    _assert_grads_match_reference(biased, leaves, {}, leaves, got, dout)
    out.backward(dout)  # the forward's graph is still usable, first order
    _assert_grads_match_reference(biased, leaves, {}, leaves, [t.grad for t in leaves], dout)


# 3. A plugin tensor's gradient and its shape ---------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradient_of_unbroadcastable_shape_refused_at_the_call(compiled):
    """(Hq,) is what the plugin accepts, but by torch's rules it broadcasts along Nk (here Nk != Hq)."""
    q, k, v = _qkv()
    w = torch.randn(HQ, requires_grad=True)
    call = torch.compile(lambda *a: head_bias(*a), backend="aot_eager", fullgraph=True) if compiled else head_bias
    with pytest.raises(
        InputError,
        match=r"_test_head_bias: its input 'w' \(argument 'w'\) requires grad and has "
        rf"shape \({HQ},\), which does not broadcast to the scores \(B, Hq, Nq, Nk\) "
        rf"= \({B}, {HQ}, {N}, {N}\).*per head, \(Hq, 1, 1\)",
    ):
        call(q, k, v, w)


def test_unbroadcastable_shape_without_gradient_runs():
    q, k, v = (t.detach() for t in _qkv())
    w = torch.randn(HQ)
    assert_matches_reference(
        head_bias(q, k, v, w), head_bias.reference(q, k, v, w), head_bias.reference(q, k, v, w, dtype=torch.float32)
    )


@pytest.mark.parametrize("shape", [(HQ, 1, 1), (1, HQ, 1, 1)], ids=str)
def test_per_head_gradient_matches_reference(shape):
    q, k, v = _qkv(Nq=17)
    w = torch.randn(shape, requires_grad=True)
    out = head_bias(q, k, v, w)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, w), dout)
    assert got[3].shape == shape
    _assert_grads_match_reference(head_bias, (q, k, v, w), {}, (q, k, v, w), got, dout)


def test_per_head_gradcheck_float64():
    q, k, v = (t.detach()[..., :9, :8].double().requires_grad_(True) for t in _qkv())
    w = torch.randn(HQ, 1, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: head_bias(*a), (q, k, v, w), fast_mode=True)
