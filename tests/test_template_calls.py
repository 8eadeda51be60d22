"""The Hopper template instances through the public API, on an H100/H200: out, lse and the gradients against
the float64 reference on HF's layout, GQA splits, partial blocks, views into NaN arenas, non-finite values and
determinism; and, on any machine, the TMA addressing and row statistics they rely on."""

import contextlib
import math

import pytest
import torch

import attnfuse as af
from attnfuse.kernels.descriptors import describable, describe
from attnfuse.kernels.dq_launch import TemplateDq
from attnfuse.kernels.launch import TemplateDkdv, TemplateForward
from attnfuse.runtime import hopper
from attnfuse.runtime.template_rows import template_rows
from attnfuse.testing import assert_matches_reference

from conftest import CUDA, deterministic_algorithms

HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0)
requires_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm90 GPU (H100/H200)")


@pytest.fixture(autouse=True)
def _every_instance(monkeypatch):
    """These check the instances themselves, whether or not the record lists them yet."""
    monkeypatch.setenv("ATTNFUSE_TEMPLATES", "all")


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def dense(q, k, v, scale):
    return af.softmax(af.full(af.scaled_dot_product(q, k, scale=scale))) @ v


def test_tensors_tma_cannot_address_fall_back():
    base = torch.empty(2 * 8 * 64 * 130, dtype=torch.bfloat16)
    hf_layout = base[: 2 * 8 * 64 * 128].view(2, 64, 8, 128).transpose(1, 2)
    assert describable(hf_layout)
    assert describable(base[: 64 * 128].view(1, 1, 64, 128).expand(1, 1, 64, 128))
    assert not describable(base[1 : 1 + 2 * 8 * 64 * 128].view(2, 8, 64, 128))  # 2-byte offset
    assert not describable(base[: 64 * 128].view(1, 1, 64, 128).expand(2, 4, 64, 128))  # stride 0
    assert not describable(base.view(2, 8, 64, 130)[..., :128])  # 260-byte rows


def test_descriptors_pass_the_checks_they_skip():
    """The instances' TMA descriptors are built without TensorDescriptor's own checks (``describable`` made
    them): each one built for a tensor ``describable`` accepts passes those checks, field for field."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    base = torch.empty(2 * 8 * 64 * 130, dtype=torch.bfloat16)
    tensors = [
        base[: 2 * 8 * 64 * 128].view(2, 64, 8, 128).transpose(1, 2),  # HF's (B, N, H, D) projections
        base[: 64 * 128].view(1, 1, 64, 128).expand(1, 1, 64, 128),
        base[: 8 * 64 * 128].view(1, 8, 64, 128),
        torch.empty(3, 5, 64, 128, dtype=torch.float32),
    ]
    described = [
        describe(t, rows, columns)
        for t in tensors
        if describable(t)
        for rows, columns in ((64, None), (128, None), (64, 64))
    ]
    described += [
        hopper.describe_rows(rows)
        for n in (64, 129)
        for rows in template_rows(torch.randn(2, 8, n), hopper.DKDV_BLOCK_M, delta=torch.randn(2, 8, n))
    ]
    assert len(described) == 16
    for d in described:
        checked = TensorDescriptor(d.base, d.shape, d.strides, d.block_shape, d.layout)
        assert checked.base is d.base
        assert (checked.shape, checked.strides, checked.block_shape, checked.layout, checked.padding) == (
            d.shape,
            d.strides,
            d.block_shape,
            d.layout,
            d.padding,
        )


@pytest.mark.parametrize("N", [64, 129, 1])
def test_template_rows_pad_each_head_to_whole_query_blocks(N):
    """The dK/dV template's lse and delta rows: lse in log2 units (+inf where a row keeps no key), each
    (batch, head)'s N values padded with +inf and 0 to whole 64-row blocks, 16-byte aligned for TMA; the
    given delta as it is (on strided views, run by the interpreter here)."""
    B, H, block = 2, 3, hopper.DKDV_BLOCK_M
    lse = torch.randn(B, H, 2 * N)[..., ::2]
    lse[0, 1, 0] = float("-inf")  # a row that keeps no key
    delta = torch.randn(B, N, H).transpose(1, 2)
    lse_rows, delta_rows = template_rows(lse, block, delta=delta)
    padded = -(-N // block) * block
    assert lse_rows.shape == delta_rows.shape == (B * H * padded,)
    assert lse_rows.data_ptr() % 16 == 0 and delta_rows.data_ptr() % 16 == 0 and padded * 4 % 16 == 0
    want = torch.where(lse == float("-inf"), float("inf"), lse.double() * math.log2(math.e))
    torch.testing.assert_close(lse_rows.view(B, H, padded)[..., :N].double(), want, rtol=1e-6, atol=0)
    assert torch.equal(delta_rows.view(B, H, padded)[..., :N], delta)
    assert (lse_rows.view(B, H, padded)[..., N:] == float("inf")).all()
    assert not delta_rows.view(B, H, padded)[..., N:].any()
    assert hopper.lse_rows_fit(lse)
    assert not hopper.lse_rows_fit(torch.empty(1).expand(2**16, 2**8, 2**7 - 1))


def test_dkdv_group_parts(monkeypatch):
    """How many programs share a GQA group's query heads: none split when the whole-group grid fills an
    H200 (132 multiprocessors) once; else the fewest parts (divisors of the group) that fill it 1.5 times."""
    from attnfuse.runtime.hopper import _group_parts

    monkeypatch.setattr(hopper, "multiprocessors", lambda device: 132)
    assert [_group_parts(programs, 4, None) for programs in (132, 128, 99, 64, 30)] == [1, 2, 2, 4, 4]
    assert [_group_parts(programs, 6, None) for programs in (128, 60, 20)] == [2, 6, 6]
    assert _group_parts(10, 1, None) == 1


def reference_grads(program, leaves, args, dout, dtype=torch.float64):
    """The reference's gradients of ``leaves`` (q, k, v) for ``dout``, one key head and its query heads at a
    time, so that a float64 reference of 1 x 32 x 4096² (a few GiB for its whole scores) fits beside the other
    test processes sharing the GPU."""
    q, k, v = leaves
    group = q.shape[1] // k.shape[1]
    total = [None, None, None]
    for h in range(k.shape[1]):
        rows = slice(h * group, (h + 1) * group)
        out = program.reference(q[:, rows], k[:, h : h + 1], v[:, h : h + 1], *args, dtype=dtype)
        grads = torch.autograd.grad(out, leaves, dout[:, rows])
        total = [g if t is None else t + g for t, g in zip(total, grads)]
    return total


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,Hq,Hkv,Nq,Nk",
    [(2, 8, 2, 1000, 1000), (1, 4, 4, 300, 1000), (1, 4, 1, 1000, 300), (3, 6, 3, 129, 257), (1, 32, 8, 4096, 4096)],
)
@pytest.mark.parametrize("program", [causal, dense], ids=["causal", "dense"])
def test_forward_matches_float64(program, B, Hq, Hkv, Nq, Nk, dtype):
    """Out and lse of the forward instance (it ran) against the float64 reference; q in HF's (B, Nq, Hq, D)
    order. Partial blocks, GQA, Nq < Nk, and Nq > Nk (causal: the first rows keep no key: out 0, lse -inf)."""
    before = TemplateForward.launches
    q = torch.randn(B, Nq, Hq, 128, device="cuda", dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=dtype) for _ in range(2))
    args = (0.2,) if program is dense else ()
    out, lse = program(q, k, v, *args, return_lse=True)
    assert TemplateForward.launches > before, "the forward template did not run"
    ref, ref_lse = program.reference(q, k, v, *args, return_lse=True)
    assert_matches_reference(out, ref, program.reference(q, k, v, *args, dtype=dtype), dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite.to(lse.device))
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite].to(lse.device), atol=1e-4, rtol=0)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,Hq,Hkv,Nq,Nk",
    [
        (2, 8, 2, 1000, 1000),
        (1, 4, 4, 300, 1000),
        (1, 4, 1, 1000, 300),
        (3, 6, 3, 129, 257),
        (1, 32, 8, 4096, 4096),
        (1, 8, 1, 64, 40),
    ],
)
@pytest.mark.parametrize("program", [causal, dense], ids=["causal", "dense"])
def test_dkdv_matches_float64(program, B, Hq, Hkv, Nq, Nk, dtype):
    """dq, dk, dv of a training step whose dQ ran the dQ instance and dK and dV the dK/dV instance, against
    float64 autograd of the reference; q, dout and dq in HF's (B, N, H, D) order. GQA groups split over query
    heads (small grids) and looped (1 x 32 x 8 at 4096), partial blocks, Nq < Nk and Nq > Nk (causal: rows
    that keep no key)."""
    before, before_dq = TemplateDkdv.launches, TemplateDq.launches
    q = torch.randn(B, Nq, Hq, 128, device="cuda", dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=dtype) for _ in range(2))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    dout = torch.randn(B, Nq, Hq, 128, device="cuda", dtype=dtype).transpose(1, 2)
    args = (0.2,) if program is dense else ()
    grads = torch.autograd.grad(program(*leaves, *args), leaves, dout)
    assert TemplateDkdv.launches > before, "the dK/dV template did not run"
    assert TemplateDq.launches > before_dq, "the dQ template did not run"
    want = reference_grads(program, leaves, args, dout.double())
    lowp = reference_grads(program, leaves, args, dout, dtype=dtype)
    for got, ref, ref_lowp, name in zip(grads, want, lowp, "qkv"):
        assert_matches_reference(got, ref, ref_lowp, dtype, what=f"d{name}")


@requires_hopper
def test_instances_read_nothing_outside_their_views():
    """q, k, v are views into NaN arenas (rows before and after, a wider head dim): partial tiles read
    zeros, not the neighbours (a NaN would spread); out, lse and the gradients (the dQ instance, then the dK/dV
    instance) match float64."""
    forward, backward, dq = TemplateForward.launches, TemplateDkdv.launches, TemplateDq.launches
    B, Hq, Hkv, N, D = 2, 4, 2, 200, 128
    views = []
    for heads in (Hq, Hkv, Hkv):
        arena = torch.full((B, heads, N + 300, D + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
        view = arena[:, :, 150 : 150 + N, 32 : 32 + D]
        view.copy_(torch.randn(B, heads, N, D))
        views.append(view.requires_grad_())
    out, lse = causal(*views, return_lse=True)
    assert TemplateForward.launches > forward and not out.isnan().any() and not lse.isnan().any()
    ref, ref_lse = causal.reference(*views, return_lse=True)
    assert_matches_reference(out, ref, causal.reference(*views, dtype=torch.bfloat16), torch.bfloat16)
    torch.testing.assert_close(lse.double(), ref_lse.to(lse.device), atol=1e-4, rtol=0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, views, dout)
    ref_grads = torch.autograd.grad(causal.reference(*views), views, dout.double())
    lowp_grads = torch.autograd.grad(causal.reference(*views, dtype=torch.bfloat16), views, dout)
    assert TemplateDkdv.launches > backward and TemplateDq.launches > dq
    for got, want, lowp, name in zip(grads, ref_grads, lowp_grads, "qkv"):
        assert_matches_reference(got, want, lowp, torch.bfloat16, what=f"d{name}")


@requires_hopper
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("program", [causal, dense], ids=["causal", "dense"])
@pytest.mark.parametrize(
    "B,Hq,Hkv,Nq,Nk", [(2, 8, 2, 700, 900), (1, 32, 8, 1500, 1700)], ids=["four-parts", "two-parts"]
)
def test_backward_through_lse(program, deterministic, B, Hq, Hkv, Nq, Nk):
    """A loss of out and lse (so dlse enters delta, which the dQ instance computes) through the dQ and dK/dV
    instances, against float64 autograd of the reference; under torch.use_deterministic_algorithms its
    gradients are bitwise equal from step to step. Partial blocks, GQA groups split over four programs (their
    shares added atomically, or under determinism summed in order by the last) or two (summed by the last), on
    an H200's 132 multiprocessors."""
    before, before_dq = TemplateDkdv.launches, TemplateDq.launches
    leaves = [
        torch.randn(B, h, n, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk))
    ]
    dout, dlse = torch.randn(B, Hq, Nq, 128, device="cuda", dtype=torch.bfloat16), torch.randn(B, Hq, Nq, device="cuda")
    args = (0.1,) if program is dense else ()

    def step(fn):
        out, lse = fn(*leaves, *args, return_lse=True)
        return torch.autograd.grad((out.double() * dout.double()).sum() + (lse.double() * dlse.double()).sum(), leaves)

    with deterministic_algorithms() if deterministic else contextlib.nullcontext():
        grads = step(program)
        if deterministic:
            assert all(torch.equal(a, b) for a, b in zip(grads, step(program)))
    assert TemplateDkdv.launches > before and TemplateDq.launches > before_dq
    want = step(program.reference)
    lowp = step(lambda *a, **kw: program.reference(*a, **kw, dtype=torch.bfloat16))
    for got, ref, ref_lowp, name in zip(grads, want, lowp, "qkv"):
        assert_matches_reference(got, ref, ref_lowp, torch.bfloat16, what=f"d{name}")


@requires_hopper
@pytest.mark.parametrize("program", [causal, dense], ids=["causal", "dense"])
def test_forward_non_finite_values_match_the_math(program):
    """Non-finite values in v, in and outside the causal diagonal blocks, two of them in one 16-key step in
    different columns: a row that masks such a key stays finite; one that keeps it is non-finite exactly in
    that key's column, as float64's is (the careful redo; the rest of the rows and columns unchanged)."""
    before = TemplateForward.launches
    q, k, v = (torch.randn(1, 2, 700, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v[0, 0, 300, 7], v[0, 0, 301, 90], v[0, 1, 650, 3], v[0, 1, 20, 5] = (
        float("nan"),
        float("inf"),
        float("-inf"),
        float("nan"),
    )
    args = (0.1,) if program is dense else ()
    out, lse = program(q, k, v, *args, return_lse=True)
    assert TemplateForward.launches > before
    want, want_lse = program.reference(q, k, v, *args, return_lse=True)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out).cpu(), finite.cpu())
    assert_matches_reference(
        out.double().where(finite, 0),
        want.where(finite, 0),
        program.reference(q, k, v, *args, dtype=torch.bfloat16).where(finite, 0),
        torch.bfloat16,
    )
    torch.testing.assert_close(lse.double(), want_lse.to(lse.device), atol=1e-4, rtol=0)


@requires_hopper
def test_tensors_tma_cannot_address_run_the_generated_kernel():
    before = TemplateForward.launches
    flat = torch.randn(2 * 8 * 500 * 128 + 1, device="cuda", dtype=torch.float16)
    q = flat[1:].view(2, 8, 500, 128)  # 2 bytes past an aligned base
    k, v = (torch.randn(2, 8, 500, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    out = causal(q, k, v)
    assert TemplateForward.launches == before
    assert_matches_reference(
        out, causal.reference(q, k, v), causal.reference(q, k, v, dtype=torch.float16), torch.float16
    )
