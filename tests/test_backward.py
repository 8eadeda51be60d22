"""Gradients through the fused kernels: against float64 autograd of the reference, gradcheck, determinism."""

import pytest
import torch

import attnfuse as af
from attnfuse.combinator import Combinator, Role, ScoreModFragment
from attnfuse.runtime.backward import split_blocks
from attnfuse.testing import assert_matches_reference

from conftest import hoisted_last_call


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def window(q, k, v):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 20, 5)) @ v


@af.attention
def alibi_bias(q, k, v, bias):
    return af.softmax(af.additive_bias(af.alibi(af.causal(af.rope(q, k))), bias)) @ v


@af.attention
def relu_causal(q, k, v):
    return af.relu_attention(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def rope_tables(q, k, v, cos, sin):
    return af.softmax(af.rope(q, k, cos=cos, sin=sin)) @ v


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


def _qkv(B, Hq, Hkv, Nq, Nk, D, DV, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)
        for shape in ((B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, DV))
    )


def _check_grads(program, q, k, v, *extra, leaves=()):
    out = program(q, k, v, *extra)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out.dtype)
    inputs = (q, k, v, *leaves)
    got = torch.autograd.grad(out, inputs, dout)
    want64 = torch.autograd.grad(program.reference(q, k, v, *extra), inputs, dout.double())
    want_lowp = torch.autograd.grad(program.reference(q, k, v, *extra, dtype=q.dtype), inputs, dout)
    for name, a, b, c in zip(("dq", "dk", "dv", "dextra"), got, want64, want_lowp):
        assert a.dtype == q.dtype and a.shape == b.shape
        summed = out.numel() // out.shape[-1] * k.shape[2] // b.numel() if name == "dextra" else 1
        assert_matches_reference(a, b, c, q.dtype, what=name, summed=summed)


SHAPES = [  # B, Hq, Hkv, Nq, Nk, D, DV: GQA with Nq != Nk off the block grid; MQA, D=80; DV != D; on the
    # interpreter's 32-row tiles (EVEN_M and EVEN_K: no bounds masks), and EVEN_M alone
    (2, 4, 2, 40, 70, 32, 32),
    (1, 3, 1, 40, 40, 80, 80),
    (1, 2, 1, 33, 65, 16, 48),
    (2, 4, 2, 64, 96, 32, 32),
    (1, 2, 2, 64, 70, 32, 32),
]


@pytest.mark.parametrize("program", [causal, llama, window, relu_causal], ids=lambda p: p.__name__)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gradients_match_reference(program, shape):
    _check_grads(program, *_qkv(*shape, torch.float32))


@pytest.mark.parametrize("program", [causal, llama], ids=lambda p: p.__name__)
def test_gradients_match_reference_float16(program):
    _check_grads(program, *_qkv(*SHAPES[0], torch.float16))


@pytest.mark.parametrize("bias_shape", [(2, 4, 30, 45), (1, 4, 30, 45), (30, 45), (45,), (2, 1, 1, 45)])
def test_bias_gradient_is_reduced_over_broadcast_dims(bias_shape):
    q, k, v = _qkv(2, 4, 2, 30, 45, 32, 32, torch.float32, seed=1)
    bias = torch.randn(bias_shape, requires_grad=True)
    _check_grads(alibi_bias, q, k, v, bias, leaves=(bias,))


@pytest.mark.parametrize(
    "program,extra",
    [
        (alibi_bias, lambda: (torch.randn(1, 2, 9, 11, dtype=torch.float64, requires_grad=True),)),
        (window, lambda: ()),
        (relu_causal, lambda: ()),
        (rope_tables, lambda: (torch.rand(11, 8, dtype=torch.float64), torch.rand(11, 8, dtype=torch.float64))),
    ],
    ids=["rope-alibi-bias", "window", "relu", "rope-tables"],
)
def test_gradcheck_float64(program, extra):
    q, k, v = _qkv(1, 2, 1, 9, 11, 8, 8, torch.float64, seed=3)
    args = extra()
    tensors = (q, k, v, *(a for a in args if isinstance(a, torch.Tensor) and a.requires_grad))

    def f(q, k, v, *grad_args):
        it = iter(grad_args)
        return program(q, k, v, *(next(it) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args))

    assert torch.autograd.gradcheck(f, tensors, fast_mode=True)


def test_block_sparse_gradients_over_several_blocks_float64():
    """A per-head layout of 3 x 4 blocks of 16 (Nq = 40, Nk = 55: the last row and column of blocks ragged),
    random, with skipped blocks, rows and columns listing different counts, and no query block left empty:
    gradients match float64 autograd through the reference, and gradcheck passes."""
    blocks = torch.rand(1, 2, 3, 4) < 0.5
    blocks[..., torch.arange(3), torch.randint(0, 4, (3,))] = True  # every query block keeps something
    blocks[..., 1, 2] = False  # and some block is skipped in each head
    assert (blocks.sum(-1) != blocks.sum(-2)[..., :3]).any()  # row and column lists differ
    mask = af.BlockMask.from_blocks(blocks, 40, 55, block_size=16)
    q, k, v = _qkv(1, 2, 2, 40, 55, 8, 8, torch.float64, seed=int(torch.randint(0, 2**31 - 1, ())))
    _check_grads(sparse, q, k, v, mask)
    assert torch.autograd.gradcheck(lambda q, k, v: sparse(q, k, v, mask), (q, k, v), fast_mode=True)


@pytest.mark.parametrize("program", [causal, llama, window], ids=lambda p: p.__name__)
@pytest.mark.parametrize(
    "shape,split",
    [((1, 4, 1, 96, 96), 3), ((1, 4, 1, 30, 30), 1), ((1, 6, 2, 50, 80), 3), ((2, 4, 2, 64, 64), 0)],
    ids=str,
)
def test_gqa_key_blocks_split_over_the_group_heads(program, shape, split):
    """A GQA dK/dV grid too small for the GPU (here the interpreter's 8 programs) runs its key blocks as one
    program per query head, and the group's last program sums the shares; a block that fewer than 64 query
    rows see (the interpreter's threshold) runs whole in its group's first program, the others leaving at
    once; a large enough grid splits nothing. Gradients match float64, and a second run is bitwise equal."""
    B, Hq, Hkv, Nq, Nk = shape
    assert split_blocks(-(-Nk // 32), B * Hkv, Hq // Hkv, torch.device("cpu")) == (split, 64)  # 32-key tiles
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, 32, 32, torch.float32, seed=11)
    _check_grads(program, q, k, v)
    dout = torch.randn(B, Hq, Nq, 32)
    first, second = (torch.autograd.grad(program(q, k, v), (q, k, v), dout) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_gradients_are_deterministic():
    q, k, v = _qkv(2, 4, 2, 70, 70, 32, 32, torch.float32, seed=5)
    bias = torch.randn(4, 70, 70, requires_grad=True)
    runs = []
    for _ in range(2):
        out = alibi_bias(q, k, v, bias)
        runs.append(torch.autograd.grad(out.square().sum(), (q, k, v, bias)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_lse_gradient():
    q, k, v = _qkv(1, 2, 2, 40, 50, 32, 32, torch.float32, seed=7)
    out, lse = causal(q, k, v, return_lse=True)
    ref_out, ref_lse = causal.reference(q, k, v, return_lse=True)
    w = torch.randn(lse.shape)
    got = torch.autograd.grad(out.sum() + (lse * w).sum(), (q, k, v))
    want = torch.autograd.grad(ref_out.sum() + (ref_lse * w.double()).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=0)


def test_fully_masked_rows_have_zero_gradient():
    q, k, v = _qkv(1, 2, 2, 50, 20, 32, 32, torch.float32, seed=9)  # Nq > Nk: 30 rows see no key
    dq, dk, dv = torch.autograd.grad(causal(q, k, v).sum(), (q, k, v))
    assert torch.equal(dq[:, :, :30], torch.zeros_like(dq[:, :, :30]))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_backward_never_visits_masked_blocks():
    """dQ of rows < 64 ignores keys >= 64; dK, dV of keys >= 64 ignore queries < 64 (causal)."""
    q, k, v = _qkv(1, 2, 2, 128, 128, 32, 32, torch.float32, seed=11)
    dout = torch.randn(1, 2, 128, 32)
    clean = torch.autograd.grad(causal(q, k, v), (q, k, v), dout)
    v_poisoned = v.detach().clone()
    v_poisoned[:, :, 64:] = float("nan")
    v_poisoned.requires_grad_(True)
    dq = torch.autograd.grad(causal(q, k, v_poisoned), (q,), dout)[0]
    assert torch.equal(dq[:, :, :64], clean[0][:, :, :64])
    q_poisoned = q.detach().clone()
    q_poisoned[:, :, :64] = float("nan")
    q_poisoned.requires_grad_(True)
    dk, dv = torch.autograd.grad(causal(q_poisoned, k, v), (k, v), dout)
    assert torch.equal(dk[:, :, 64:], clean[1][:, :, 64:]) and torch.equal(dv[:, :, 64:], clean[2][:, :, 64:])


def test_combinator_without_backward_refuses_gradients():
    no_grad_mod = Combinator(
        name="_test_scaled_by_two",
        role=Role.SCORE_MOD,
        doc="s * 2, with no backward.",
        reference=lambda s, ctx: s * 2,
        fragment=ScoreModFragment(body="s = s * 2.0"),
    )

    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [no_grad_mod]

    af.register_plugin(Plugin(), name="test-no-backward")
    try:

        @af.attention
        def doubled(q, k, v):
            return af.softmax(af._test_scaled_by_two(af.scaled_dot_product(q, k))) @ v

        q, k, v = _qkv(1, 2, 2, 16, 16, 16, 16, torch.float32)
        with pytest.raises(
            af.ProgramError,
            match=r"gradients were asked for, but the score modification "
            r"_test_scaled_by_two declares no backward",
        ):
            doubled(q, k, v)
        with torch.no_grad():
            torch.testing.assert_close(doubled(q, k, v).double(), doubled.reference(q, k, v), atol=2e-5, rtol=0)
    finally:
        af.unregister_plugin("test-no-backward")


def test_hoisted_backward_reuses_the_forwards_transformed_rows(monkeypatch):
    """The forward's transform pass writes rotated q and k once (one launch); the backward reads those
    copies and runs only the gradient pass (one launch)."""
    from attnfuse.runtime import hoisted

    calls = []
    original = hoisted.TransformPass.__call__

    def counting(self, rows, *args, grads=None, **kwargs):
        calls.append((self.sides, "gradient" if grads is not None else "transform"))
        return original(self, rows, *args, grads=grads, **kwargs)

    monkeypatch.setattr(hoisted.TransformPass, "__call__", counting)
    q, k, v = _qkv(1, 2, 1, 150, 150, 32, 32, torch.float32)  # 5 query blocks of 32 under the interpreter
    out = llama(q, k, v)
    assert hoisted_last_call() and calls == [(("q", "k"), "transform")]
    calls.clear()
    torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    assert calls == [(("q", "k"), "gradient")]


@pytest.mark.parametrize("program,extra", [(llama, ()), (alibi_bias, ("bias",))], ids=["llama", "alibi_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_hoisted_transforms_give_the_fused_gradients(monkeypatch, program, extra, dtype):
    """With many query blocks, q and k are rotated once by transform passes, plain backward kernels run on
    the copies and gradient passes rotate dQ, dK back; hoisted and fused gradients both match float64
    autograd of the reference, and in float32 each other."""
    from attnfuse.runtime import hoisted, launch

    q, k, v = _qkv(1, 4, 2, 150, 170, 80, 48, dtype)  # 5 query blocks of 32 under the interpreter
    bias = torch.randn(150, 170, generator=torch.Generator().manual_seed(5)).to(dtype).requires_grad_(True)
    args = (bias,) if extra else ()
    _check_grads(program, q, k, v, *args, leaves=args)
    assert hoisted_last_call()
    dout = torch.randn(1, 4, 150, 48, generator=torch.Generator().manual_seed(7)).to(dtype)
    hoisted_grads = torch.autograd.grad(program(q, k, v, *args), (q, k, v, *args), dout)
    monkeypatch.setattr(hoisted, "HOIST_MIN_QUERY_BLOCKS", 10**9)
    launch.clear_cache()
    fused_grads = torch.autograd.grad(program(q, k, v, *args), (q, k, v, *args), dout)
    assert not hoisted_last_call()
    _check_grads(program, q, k, v, *args, leaves=args)
    if dtype == torch.float32:  # float16 results may round an ulp apart; each matched the reference above
        for a, b in zip(hoisted_grads, fused_grads):
            torch.testing.assert_close(a, b)


class _ServingTemplate:
    """Stands in for a template's instance of a call it serves (CPU tensors never are)."""

    fits = staticmethod(lambda *tensors: True)


def _interpreted_backward(program=None):
    from attnfuse.plan import KernelConfig
    from attnfuse.runtime.compiled import compiled

    config = KernelConfig(
        arch="interpreter", dtype="float32", head_dim=16, head_dim_v=16, group=1, save_lse=True, fp32_precision="ieee"
    )
    return compiled((program or causal).graph(), config).backward()


@pytest.mark.parametrize("dq_serves", [True, False])
@pytest.mark.parametrize("serves", [True, False])
def test_the_backward_runs_each_template_instance_that_serves_the_call(monkeypatch, serves, dq_serves):
    """The dQ kernel runs first (the dQ template's instance where it serves the tensors, else the generated
    kernel), then the dK/dV kernel (the dK/dV template's instance where it serves them, else the generated
    one). Only which path runs is checked here: the instances themselves need the GPU."""
    from attnfuse.runtime.inputs import kv_cache

    kernels = _interpreted_backward()
    if serves:
        monkeypatch.setattr(kernels, "template", _ServingTemplate())
    if dq_serves:
        monkeypatch.setattr(kernels, "dq_template", _ServingTemplate())
    paths = []
    monkeypatch.setattr(kernels, "_dq_then_dkdv", lambda *args: paths.append(args[-2:]))
    q, k, v, out, dout = (torch.randn(1, 2, 24, 16) for _ in range(5))
    kernels(q, kv_cache(k, v, None, None), out, torch.randn(1, 2, 24), dout, None, {})
    assert paths == [("template" if dq_serves else "generated", "template" if serves else "generated")]


class _RecordingTemplate(_ServingTemplate):
    """Stands in for a template's instance: records each call's arguments, in the order of the calls."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, *args):
        self.calls.append((self.name, args))


def test_the_dq_instance_writes_the_delta_the_dkdv_kernel_then_reads(monkeypatch):
    """With both instances serving: the dQ instance runs first, given the call's out, dout, lse, dLSE and dq, and
    the delta buffer it writes is the one the dK/dV instance is given next (the dK/dV kernel reads delta)."""
    from attnfuse.runtime.inputs import kv_cache

    kernels = _interpreted_backward()
    calls = []
    monkeypatch.setattr(kernels, "dq_template", _RecordingTemplate("dq", calls))
    monkeypatch.setattr(kernels, "template", _RecordingTemplate("dkdv", calls))
    q, k, v, out, dout = (torch.randn(1, 2, 24, 16) for _ in range(5))
    lse, dlse = torch.randn(1, 2, 24), torch.randn(1, 2, 24)
    dq, dk, dv, _ = kernels(q, kv_cache(k, v, None, None), out, lse, dout, dlse, {})
    assert [name for name, _ in calls] == ["dq", "dkdv"]
    (_, (q1, k1, v1, out1, dout1, lse1, dlse1, delta1, dq1, _)), (_, dkdv_args) = calls
    assert all(a is b for a, b in zip((q1, k1, v1, out1, dout1, lse1, dq1), (q, k, v, out, dout, lse, dq)))
    assert torch.equal(dlse1, dlse)
    assert delta1.shape == (1, 2, 24) and delta1.dtype == torch.float32
    assert dkdv_args[5] is delta1 and dkdv_args[6] is dk and dkdv_args[7] is dv


@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_fused_dq_setting_is_deprecated_and_has_no_effect(monkeypatch, setting):
    """ATTNFUSE_FUSED_DQ chose the removed hand-written kernel's fused dQ: any setting warns, saying to unset it,
    and the gradients are the same as without it."""
    monkeypatch.setenv("ATTNFUSE_FUSED_DQ", setting)
    q, k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    with pytest.warns(DeprecationWarning, match="ATTNFUSE_FUSED_DQ has no effect and is deprecated.*unset it"):
        grads = torch.autograd.grad(causal(q, k, v).sum(), (q, k, v))
    monkeypatch.delenv("ATTNFUSE_FUSED_DQ")
    for got, want in zip(grads, torch.autograd.grad(causal.reference(q, k, v).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
