"""torch.compile: a program call is one opaque op (torch.ops.attnfuse.attention), so Dynamo sees no graph
break, fullgraph compiles run forward and backward with eager's results, and dynamic shapes do not recompile
per length. On the CPU the op runs Triton's interpreter, which Dynamo never traces (aot_eager backend)."""

import json

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import attnfuse as af
from attnfuse.errors import InputError
from attnfuse import call_spec
from attnfuse.testing import assert_matches_reference


@af.attention
def llama(q, k, v, cos, sin):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


@af.attention
def biased_sparse(q, k, v, bias, mask):
    s = af.additive_bias(af.scaled_dot_product(q, k), bias)
    return af.softmax(af.block_sparse(s, mask)) @ v


@af.attention
def decode(q, k, v, window=None):
    s = af.rope(q, k, rotate_keys=False)
    s = af.causal(s) if window is None else af.sliding_window(s, window, 0)
    return af.softmax(s) @ v


def _qkv(B=1, Hq=4, Hkv=2, N=24, D=8, requires_grad=False):
    shapes = ((B, Hq, N, D), (B, Hkv, N, D), (B, Hkv, N, D))
    return tuple(torch.randn(s).requires_grad_(requires_grad) for s in shapes)


def _tables(N, D):
    angles = torch.randn(N, D // 2) * 3
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _mask(N):
    return af.create_block_mask_from_blocks(
        lambda b, h, qb, kb: (qb >= kb) | (kb == 0), None, None, N, N, block_size=16
    )


def _paged(B=2, Hkv=2, D=8, page=16, pages=4):
    pool_k, pool_v = torch.randn(B * pages, page, Hkv, D), torch.randn(B * pages, page, Hkv, D)
    table = torch.randperm(B * pages, dtype=torch.int32).view(B, pages)
    return pool_k, pool_v, table, torch.tensor([37, 5], dtype=torch.int32)


def _breaks(fn, *args):
    return torch._dynamo.explain(fn)(*args).graph_break_count


def test_no_graph_break_for_any_kind_of_argument():
    q, k, v = _qkv()
    cos, sin = _tables(24, 8)
    bias, mask = torch.randn(1, 4, 24, 24), _mask(24)
    pool_k, pool_v, table, lens = _paged()
    assert _breaks(lambda q, k, v: llama(q, k, v, cos, sin), q, k, v) == 0
    assert _breaks(lambda q, k, v: biased_sparse(q, k, v, bias, mask), q, k, v) == 0
    assert _breaks(lambda q, k, v: decode(q, k, v, kv_lens=torch.tensor([24], dtype=torch.int32)), q, k, v) == 0
    assert (
        _breaks(
            lambda q, k, v: decode(q, k, v, window=4, kv_lens=lens, block_table=table),
            torch.randn(2, 4, 1, 8),
            pool_k,
            pool_v,
        )
        == 0
    )


def test_fullgraph_forward_and_backward_equal_eager():
    q, k, v = _qkv(requires_grad=True)
    bias = torch.randn(1, 4, 24, 24, requires_grad=True)
    mask = _mask(24)
    compiled = torch.compile(
        lambda q, k, v, bias: biased_sparse(q, k, v, bias, mask), backend="aot_eager", fullgraph=True
    )
    dout = torch.randn(1, 4, 24, 8)
    out = compiled(q, k, v, bias)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    eager = biased_sparse(q, k, v, bias, mask)
    eager_grads = torch.autograd.grad(eager, (q, k, v, bias), dout)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    q64, k64, v64, b64 = (t.detach().double().requires_grad_() for t in (q, k, v, bias))
    reference = biased_sparse.reference(q64, k64, v64, b64, mask)
    for got, want in zip(grads, torch.autograd.grad(reference, (q64, k64, v64, b64), dout.double())):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_fullgraph_return_lse_and_its_gradient():
    q, k, v = _qkv(requires_grad=True)
    cos, sin = _tables(24, 8)

    def f(q, k, v):
        out, lse = llama(q, k, v, cos, sin, return_lse=True)
        return out.sum() + lse.sum()

    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = llama.reference(q64, k64, v64, cos.double(), sin.double(), return_lse=True)
    want = torch.autograd.grad(out.sum() + lse.sum(), (q64, k64, v64))
    torch.testing.assert_close(loss.double(), out.sum() + lse.sum(), atol=1e-3, rtol=1e-5)
    for got, w in zip(grads, want):
        torch.testing.assert_close(got.double(), w, atol=2e-5, rtol=1e-4)


def _grads_match_reference(program, out, q, k, v, *extra, what=""):
    """out and the gradients of q, k, v (for a fresh random dout) against the float64 reference, with
    extra runtime inputs ``extra``."""
    want = program.reference(q, k, v, *extra)
    in_dtype = program.reference(q, k, v, *extra, dtype=torch.float32)
    assert_matches_reference(out, want, in_dtype, torch.float32, what=f"{what}out")
    dout = torch.randn(out.shape)
    for name, got, w, b in zip(
        "qkv",
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(want, (q, k, v), dout.double()),
        torch.autograd.grad(in_dtype, (q, k, v), dout),
    ):
        assert_matches_reference(got, w, b, torch.float32, what=f"{what}d{name}")


def test_dynamic_sequence_lengths_compile_once():
    """One compile over three lengths; each length's out and q, k, v gradients match float64."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda q, k, v, cos, sin: llama(q, k, v, cos, sin), backend=counter, fullgraph=True, dynamic=True
    )
    for n in (20, 33, 48):
        q, k, v = _qkv(N=n, requires_grad=True)
        cos, sin = _tables(n, 8)
        _grads_match_reference(llama, compiled(q, k, v, cos, sin), q, k, v, cos, sin, what=f"N={n}: ")
    assert counter.frame_count == 1


def test_inductor_on_the_cpu_matches_float64():
    """Inductor (the default backend) compiles the ops around the call (one compile: the first on the CPU takes
    tens of seconds); out and the gradients match float64 autograd through the reference."""
    q, k, v = _qkv(N=20, requires_grad=True)
    bias, mask = torch.randn(4, 20, 20), _mask(20)

    def layer(q, k, v):
        return biased_sparse(q * 0.5, k, v.tanh(), bias, mask).sigmoid()

    def layer_reference(q, k, v, dtype=torch.float64):
        return biased_sparse.reference(q * 0.5, k, v.tanh(), bias, mask, dtype=dtype).sigmoid()

    out = torch.compile(layer, fullgraph=True)(q, k, v)
    want, in_dtype = layer_reference(q, k, v), layer_reference(q, k, v, torch.float32)
    assert_matches_reference(out, want, in_dtype, torch.float32)
    dout = torch.randn(out.shape)
    for name, got, w, b in zip(
        "qkv",
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(want, (q, k, v), dout.double()),
        torch.autograd.grad(in_dtype, (q, k, v), dout),
    ):
        assert_matches_reference(got, w, b, torch.float32, what=f"d{name}")


def test_fullgraph_split_kv_decode_with_paged_cache():
    pool_k, pool_v, table, lens = _paged()
    q = torch.randn(2, 4, 1, 8)
    compiled = torch.compile(
        lambda q, k, v, lens, table: decode(q, k, v, window=9, kv_lens=lens, block_table=table),
        backend="aot_eager",
        fullgraph=True,
    )
    out = compiled(q, pool_k, pool_v, lens, table)
    reference = decode.reference(q, pool_k, pool_v, window=9, kv_lens=lens, block_table=table)
    torch.testing.assert_close(out.double(), reference, atol=2e-6, rtol=1e-5)


def test_op_passes_opcheck():
    """Schema, fake tensor (exact shapes, dtypes and strides), autograd registration, AOT dispatch."""
    q, k, v = _qkv(requires_grad=True)
    q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # (B, N, H, D) memory order
    bias, mask = torch.randn(1, 4, 24, 24, requires_grad=True), _mask(24)
    layout, flat = call_spec.flatten_inputs({"bias": bias, "mask": mask})
    assert layout == (("bias", None), ("mask", (24, 24, 16, mask.kv_heavy_blocks)))
    spec = call_spec.CallSpec(
        graph=biased_sparse.graph(bias, mask), inputs=layout, save_lse=True, grad=True, grads=("bias",)
    )
    torch.library.opcheck(torch.ops.attnfuse.attention.default, (call_spec.call_key(spec), q, k, v, None, None, flat))


def test_key_of_an_unseen_call_is_rebuilt():
    """A compiled graph loaded from a cache in a fresh process carries keys this process never built: their
    data, rebuilt with the IR's constructors; a key that is no spec's data is refused, and nothing in it runs."""

    @af.attention
    def scaled(q, k, v, theta):
        return af.softmax(af.sliding_window(af.rope(q, k, theta=theta, scale=-0.25), 3, 1)) @ v

    spec = call_spec.CallSpec(
        graph=scaled.graph(theta=500.0), inputs=(("bias", None),), save_lse=False, grad=False, grads=()
    )
    key = json.dumps(spec.to_data())
    assert key not in call_spec._specs and call_spec.spec_of(key) == spec
    assert call_spec.spec_of(key).graph.weights.input.input.source.record is af.combinators()["rope"]
    for bad in (
        "__import__('os')",
        "CallSpec(graph=print(1))",
        "[]",
        json.dumps({**spec.to_data(), "graph": 1}),
        key.replace('"rope"', '"no_such_combinator"'),
        key.replace('"MaskOp"', '"print"'),
    ):
        with pytest.raises(InputError, match="key must be the data of a CallSpec"):
            call_spec.spec_of(bad)
