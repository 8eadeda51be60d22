"""The Hopper templates (the forward and the dK/dV kernel): which programs and tensors they serve, that
they compile for sm90 (on any machine), and on an H100/H200 that they match the float64 reference and read
only inside their tensors."""

import contextlib
import math
import os
import re
import subprocess
import tempfile

import attrs
import pytest
import torch
import triton

import attnfuse as af
from attnfuse.examples import EXAMPLES
from attnfuse.plan import KernelConfig
from attnfuse.runtime import hopper
from attnfuse.passes.compiler import compile as compile_plan
from attnfuse.testing import assert_matches_reference

from conftest import CUDA, deterministic_algorithms

HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0)
requires_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm90 GPU (H100/H200)")
SM90 = KernelConfig(
    arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, group=4, save_lse=True, fp32_precision="ieee"
)


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def dense(q, k, v, scale):
    return af.softmax(af.full(af.scaled_dot_product(q, k, scale=scale))) @ v


@pytest.mark.parametrize(
    "program,config,served",
    [
        (causal, {}, "causal"),
        (dense, {}, "dense"),
        (causal, {"dtype": "float16"}, "causal"),
        (EXAMPLES["llama"], {"q_transformed": True, "k_transformed": True}, "causal"),  # after a transform pass
        (EXAMPLES["llama"], {}, None),
        (EXAMPLES["mistral"], {}, None),
        (EXAMPLES["alibi"], {}, None),
        (EXAMPLES["relu"], {}, None),
        (causal, {"kv_lens": True}, None),
        (causal, {"paged": True}, None),
        (causal, {"arch": "sm80"}, None),
        (causal, {"dtype": "float32"}, None),
        (causal, {"head_dim": 96, "head_dim_v": 96}, None),
        (causal, {"head_dim_v": 64}, None),
        (causal, {"head_dim": 64, "head_dim_v": 64}, None),
    ],
)
def test_plan_serves_softmax_with_causal_or_no_mask_on_sm90(program, config, served):
    graph = program.graph(0.3) if program is dense else program.graph()
    plan = compile_plan(graph, attrs.evolve(SM90, **config))
    if served is None:
        assert plan.hopper is None
    else:
        assert plan.hopper is not None and plan.hopper.causal == (served == "causal")
        scale = 0.3 if program is dense else plan.config.head_dim**-0.5
        assert plan.hopper.qk_scale == pytest.approx(scale * 1.4426950408889634)
        assert plan.hopper.scale == pytest.approx(scale)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_plan_leaves_scales_not_above_zero_to_the_generated_kernels(scale):
    """The forward template keeps its running max on q·kᵀ unscaled, which only a positive scale allows."""
    assert compile_plan(dense.graph(scale), SM90).hopper is None
    assert compile_plan(dense.graph(0.3), SM90).hopper is not None


def test_tensors_tma_cannot_address_fall_back():
    base = torch.empty(2 * 8 * 64 * 130, dtype=torch.bfloat16)
    hf_layout = base[: 2 * 8 * 64 * 128].view(2, 64, 8, 128).transpose(1, 2)
    assert hopper.HopperLauncher.fits(hf_layout)
    assert hopper.HopperLauncher.fits(base[: 64 * 128].view(1, 1, 64, 128).expand(1, 1, 64, 128))
    assert not hopper.HopperLauncher.fits(base[1 : 1 + 2 * 8 * 64 * 128].view(2, 8, 64, 128))  # 2-byte offset
    assert not hopper.HopperLauncher.fits(base[: 64 * 128].view(1, 1, 64, 128).expand(2, 4, 64, 128))  # stride 0
    assert not hopper.HopperLauncher.fits(base.view(2, 8, 64, 130)[..., :128])  # 260-byte rows


def test_descriptors_pass_the_checks_they_skip():
    """The launcher builds TMA descriptors without TensorDescriptor's own checks (``fits`` made them): each
    one it builds for a tensor ``fits`` accepts passes those checks, field for field."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    base = torch.empty(2 * 8 * 64 * 130, dtype=torch.bfloat16)
    tensors = [
        base[: 2 * 8 * 64 * 128].view(2, 64, 8, 128).transpose(1, 2),  # HF's (B, N, H, D) projections
        base[: 64 * 128].view(1, 1, 64, 128).expand(1, 1, 64, 128),
        base[: 8 * 64 * 128].view(1, 8, 64, 128),
        torch.empty(3, 5, 64, 128, dtype=torch.float32),
    ]
    described = [
        hopper.HopperLauncher._describe(t, rows, columns)
        for t in tensors
        if hopper.HopperLauncher.fits(t)
        for rows, columns in ((64, None), (128, None), (64, 64))
    ]
    described += [
        hopper.HopperLauncher._describe_rows(rows)
        for n in (64, 129)
        for rows in hopper.HopperLauncher.rows(torch.randn(2, 8, n), delta=torch.randn(2, 8, n))
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
    lse_rows, delta_rows = hopper.HopperLauncher.rows(lse, delta=delta)
    padded = -(-N // block) * block
    assert lse_rows.shape == delta_rows.shape == (B * H * padded,)
    assert lse_rows.data_ptr() % 16 == 0 and delta_rows.data_ptr() % 16 == 0 and padded * 4 % 16 == 0
    want = torch.where(lse == float("-inf"), float("inf"), lse.double() * math.log2(math.e))
    torch.testing.assert_close(lse_rows.view(B, H, padded)[..., :N].double(), want, rtol=1e-6, atol=0)
    assert torch.equal(delta_rows.view(B, H, padded)[..., :N], delta)
    assert (lse_rows.view(B, H, padded)[..., N:] == float("inf")).all()
    assert not delta_rows.view(B, H, padded)[..., N:].any()
    assert hopper.HopperLauncher.rows_fit(lse)
    assert not hopper.HopperLauncher.rows_fit(torch.empty(1).expand(2**16, 2**8, 2**7 - 1))
    with pytest.raises(ValueError, match="zeroed"):  # only the launch that computes delta zeroes
        hopper.HopperLauncher.rows(lse, delta=delta, zeroed=torch.ones(B, H, N, 16))


@pytest.mark.parametrize("causal_mask", [True, False])
def test_kernel_compiles_for_sm90_within_shared_memory(causal_mask):
    """The Gluon kernel through Triton and ptxas for sm90 (no GPU needed), in an H100's shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from attnfuse.runtime.hopper_kernel import hopper_forward_kernel

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, 128], gl.bfloat16)
        return f"tensordesc<bf16[1, 1, {rows}, 128],{layout!r}>"

    signature = {
        "q_desc": desc(64),
        "k_desc": desc(128),
        "v_desc": desc(128),
        "o_desc": desc(64),
        "q": "*bf16",
        "k": "*bf16",
        "v": "*bf16",
        "out": "*bf16",
        "lse": "*fp32",
        "n_q": "i32",
        "n_k": "i32",
        "heads_q": "i32",
        "group": "i32",
        "qk_scale": "fp32",
        "BLOCK_N": "constexpr",
        "STAGES": "constexpr",
        "CAUSAL": "constexpr",
        "SAVE_LSE": "constexpr",
    }
    constants = {"BLOCK_N": 128, "STAGES": 3, "CAUSAL": causal_mask, "SAVE_LSE": True}
    compiled = triton.compile(
        GluonASTSource(hopper_forward_kernel, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "maxnreg": 168},
    )
    # the ptxas Triton compiled with: torch.compile sets TRITON_PTXAS_PATH to torch's own (a newer CUDA), whose
    # PTX version an older ptxas refuses
    ptxas = triton.knobs.nvidia.ptxas.path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True, text=True)
    assert run.returncode == 0, f"ptxas exited with {run.returncode}:\n{run.stdout}\n{run.stderr}"
    report = run.stderr
    assert re.search(r"Used \d+ registers", report), report
    assert compiled.metadata.shared <= 232448  # an H100's shared memory per block


@pytest.mark.parametrize(
    "causal_mask,group_sum,fuse_dq",
    [(True, "none", True), (False, "atomic", True), (True, "last", True), (True, "none", False)],
)
def test_dkdv_kernel_compiles_for_sm90_within_shared_memory(causal_mask, group_sum, fuse_dq):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from attnfuse.runtime.hopper_dkdv_kernel import hopper_dkdv_kernel

    layout = gl.NVMMASharedLayout.get_default_for([1, 1, 64, 128], gl.bfloat16)
    tile = f"tensordesc<bf16[1, 1, 64, 128],{layout!r}>"
    dq_layout = gl.NVMMASharedLayout.get_default_for([1, 1, 64, 64], gl.float32)
    dq_tile = f"tensordesc<fp32[1, 1, 64, 64],{dq_layout!r}>" if fuse_dq else "constexpr"
    rows = f"tensordesc<fp32[{hopper.DKDV_BLOCK_M}],{hopper._ROW_LAYOUT!r}>"
    signature = {
        "q_desc": tile,
        "do_desc": tile,
        "k_desc": tile,
        "v_desc": tile,
        "lse_desc": rows,
        "delta_desc": rows,
        "dk": "*bf16",
        "dv": "*bf16",
        "dq_desc": dq_tile,
        "dk_part": "*fp32",
        "dv_part": "*fp32",
        "part_size": "i32",
        "counts": "*i32",
        **{f"stride_d{x}{y}": "i32" for x in "kv" for y in "bhn"},
        **{name: "i32" for name in ("n_q", "n_k", "heads_q", "group", "heads", "row_stride")},
        "qk_scale": "fp32",
        "scale": "fp32",
        "BLOCK_M": "constexpr",
        "STAGES": "constexpr",
        "CAUSAL": "constexpr",
        "GROUP_SUM": "constexpr",
        "FUSE_DQ": "constexpr",
    }
    constants = {
        "BLOCK_M": hopper.DKDV_BLOCK_M,
        "STAGES": hopper.DKDV_STAGES,
        "CAUSAL": causal_mask,
        "GROUP_SUM": group_sum,
        "FUSE_DQ": fuse_dq,
        **({} if fuse_dq else {"dq_desc": None}),
    }
    compiled = triton.compile(
        GluonASTSource(hopper_dkdv_kernel, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "maxnreg": 168},
    )
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert ("cp.reduce.async.bulk.tensor" in ptx) == fuse_dq
    assert ("atom.global.gpu.relaxed.add.f32" in ptx) == (group_sum == "atomic")  # the shares' adds
    assert ("atom.global.gpu.acq_rel.add" in ptx) == (group_sum == "last")  # their count
    assert compiled.metadata.shared <= 232448


def test_dkdv_group_parts(monkeypatch):
    """How many programs share a GQA group's query heads: none split when the whole-group grid fills an
    H200 (132 multiprocessors) once; else the fewest parts (divisors of the group) that fill it 1.5 times."""
    from attnfuse.runtime.hopper import _group_parts

    monkeypatch.setattr(hopper, "multiprocessors", lambda device: 132)
    assert [_group_parts(programs, 4, None) for programs in (132, 128, 99, 64, 30)] == [1, 2, 2, 4, 4]
    assert [_group_parts(programs, 6, None) for programs in (128, 60, 20)] == [2, 6, 6]
    assert _group_parts(10, 1, None) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_template_rows_delta_matches_float64(dtype, with_dlse):
    """The fused-dQ backward's row statistics kernel: delta = rowsum(dO ∘ O) − dlse on strided (B, H, N, D)
    views against float64, 0 in the padding (run by the interpreter here, compiled on a GPU by the tests
    below), and the accumulator it zeroes, in (B, H, N, D) or HF's (B, N, H, D) memory order."""
    from attnfuse.runtime.template_rows import ROWS

    B, H, N, D = 2, 3, ROWS + 5, 64
    padded = -(-N // hopper.DKDV_BLOCK_M) * hopper.DKDV_BLOCK_M
    out = torch.randn(B, N, H, D, dtype=dtype).transpose(1, 2)  # HF's layout
    dout = torch.randn(B, H, N, 2 * D, dtype=dtype)[..., ::2]  # a last stride of 2
    dlse = torch.randn(B, H, N) if with_dlse else None
    lse = torch.randn(B, H, N)
    want = (out.double() * dout.double()).sum(-1) - (dlse.double() if with_dlse else 0)
    for acc in None, torch.randn(B, H, N, D), torch.randn(B, N, H, D).transpose(1, 2):  # dQ's, in q's order
        _, delta_rows = hopper.HopperLauncher.rows(lse, out=out, dout=dout, dlse=dlse, zeroed=acc)
        torch.testing.assert_close(delta_rows.view(B, H, padded)[..., :N].double(), want, rtol=0, atol=1e-5)
        assert not delta_rows.view(B, H, padded)[..., N:].any()
        assert acc is None or not acc.any()


def _spy(monkeypatch, method="__call__"):
    """The list to which each call of the launcher's ``method`` (the forward, or "dkdv") appends its
    arguments (the dK/dV kernel's eighth is dQ's accumulator, when it computes dQ too)."""
    calls = []
    launch = getattr(hopper.HopperLauncher, method)
    monkeypatch.setattr(hopper.HopperLauncher, method, lambda self, *a: (calls.append(a), launch(self, *a))[1])
    return calls


def _fused_dq(calls) -> bool:
    """Whether every dK/dV template call that ``_spy`` recorded computed dQ too."""
    return all(len(args) == 8 for args in calls)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,Hq,Hkv,Nq,Nk",
    [(2, 8, 2, 1000, 1000), (1, 4, 4, 300, 1000), (1, 4, 1, 1000, 300), (3, 6, 3, 129, 257), (1, 32, 8, 4096, 4096)],
)
@pytest.mark.parametrize("program", [causal, dense], ids=["causal", "dense"])
def test_hopper_forward_matches_float64(monkeypatch, program, B, Hq, Hkv, Nq, Nk, dtype):
    """Out and lse of the template (it ran) against the float64 reference; q in HF's (B, Nq, Hq, D) order.
    Partial blocks, GQA, Nq < Nk, and Nq > Nk (causal: the first rows keep no key: out 0, lse -inf)."""
    calls = _spy(monkeypatch)
    q = torch.randn(B, Nq, Hq, 128, device="cuda", dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=dtype) for _ in range(2))
    args = (0.2,) if program is dense else ()
    out, lse = program(q, k, v, *args, return_lse=True)
    assert calls, "the Hopper template did not run"
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
def test_hopper_dkdv_matches_float64(monkeypatch, program, B, Hq, Hkv, Nq, Nk, dtype):
    """dq, dk, dv of a training step whose dQ, dK and dV ran the template (asked for with ATTNFUSE_FUSED_DQ=1),
    against float64 autograd of the reference; q and dout in HF's (B, N, H, D) order. GQA groups split over
    query heads (small grids) and looped (1 x 32 x 8 at 4096), partial blocks, Nq < Nk and Nq > Nk (causal:
    rows that keep no key)."""
    monkeypatch.setenv("ATTNFUSE_FUSED_DQ", "1")
    calls = _spy(monkeypatch, "dkdv")
    q = torch.randn(B, Nq, Hq, 128, device="cuda", dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=dtype) for _ in range(2))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    dout = torch.randn(B, Nq, Hq, 128, device="cuda", dtype=dtype).transpose(1, 2)
    args = (0.2,) if program is dense else ()
    grads = torch.autograd.grad(program(*leaves, *args), leaves, dout)
    assert calls, "the Hopper dK/dV template did not run"
    assert _fused_dq(calls), "the Hopper dK/dV template did not compute dQ"
    want = torch.autograd.grad(program.reference(*leaves, *args), leaves, dout.double())
    lowp = torch.autograd.grad(program.reference(*leaves, *args, dtype=dtype), leaves, dout)
    for got, ref, ref_lowp, name in zip(grads, want, lowp, "qkv"):
        assert_matches_reference(got, ref, ref_lowp, dtype, what=f"d{name}")


@requires_hopper
def test_hopper_forward_reads_nothing_outside_its_views(monkeypatch):
    """q, k, v are views into NaN arenas (rows before and after, a wider head dim): partial tiles read
    zeros, not the neighbours (a NaN would spread); out, lse and the gradients (the dK/dV template too, by
    default after the generated dQ kernel) match float64."""
    monkeypatch.delenv("ATTNFUSE_FUSED_DQ", raising=False)
    calls, backward = _spy(monkeypatch), _spy(monkeypatch, "dkdv")
    B, Hq, Hkv, N, D = 2, 4, 2, 200, 128
    views = []
    for heads in (Hq, Hkv, Hkv):
        arena = torch.full((B, heads, N + 300, D + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
        view = arena[:, :, 150 : 150 + N, 32 : 32 + D]
        view.copy_(torch.randn(B, heads, N, D))
        views.append(view.requires_grad_())
    out, lse = causal(*views, return_lse=True)
    assert calls and not out.isnan().any() and not lse.isnan().any()
    ref, ref_lse = causal.reference(*views, return_lse=True)
    assert_matches_reference(out, ref, causal.reference(*views, dtype=torch.bfloat16), torch.bfloat16)
    torch.testing.assert_close(lse.double(), ref_lse.to(lse.device), atol=1e-4, rtol=0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, views, dout)
    ref_grads = torch.autograd.grad(causal.reference(*views), views, dout.double())
    lowp_grads = torch.autograd.grad(causal.reference(*views, dtype=torch.bfloat16), views, dout)
    assert backward and not any(_fused_dq([args]) for args in backward)
    for got, want, lowp, name in zip(grads, ref_grads, lowp_grads, "qkv"):
        assert_matches_reference(got, want, lowp, torch.bfloat16, what=f"d{name}")


@requires_hopper
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused-dq", "deterministic"])
@pytest.mark.parametrize("program", [causal, dense], ids=["causal", "dense"])
@pytest.mark.parametrize(
    "B,Hq,Hkv,Nq,Nk", [(2, 8, 2, 700, 900), (1, 32, 8, 1500, 1700)], ids=["four-parts", "two-parts"]
)
def test_hopper_backward_through_lse(monkeypatch, program, deterministic, B, Hq, Hkv, Nq, Nk):
    """A loss of out and lse (so dlse enters delta), with dQ in the template (float32 reduce-adds, asked for
    with ATTNFUSE_FUSED_DQ=1) or, under torch.use_deterministic_algorithms (which overrules that), in the
    generated dQ kernel, whose gradients are then bitwise
    equal from step to step; against float64 autograd of the reference. Partial blocks, GQA groups split
    over four programs or (by default summed by the last of them) two, on an H200's 132 multiprocessors."""
    monkeypatch.setenv("ATTNFUSE_FUSED_DQ", "1")
    calls = _spy(monkeypatch, "dkdv")
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
    assert calls and _fused_dq(calls) != deterministic
    want = step(program.reference)
    lowp = step(lambda *a, **kw: program.reference(*a, **kw, dtype=torch.bfloat16))
    for got, ref, ref_lowp, name in zip(grads, want, lowp, "qkv"):
        assert_matches_reference(got, ref, ref_lowp, torch.bfloat16, what=f"d{name}")


@requires_hopper
@pytest.mark.parametrize("program", [causal, dense], ids=["causal", "dense"])
def test_hopper_forward_non_finite_values_match_the_math(monkeypatch, program):
    """Non-finite values in v, in and outside the causal diagonal blocks, two of them in one 16-key step in
    different columns: a row that masks such a key stays finite; one that keeps it is non-finite exactly in
    that key's column, as float64's is (the careful redo; the rest of the rows and columns unchanged)."""
    calls = _spy(monkeypatch)
    q, k, v = (torch.randn(1, 2, 700, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v[0, 0, 300, 7], v[0, 0, 301, 90], v[0, 1, 650, 3], v[0, 1, 20, 5] = (
        float("nan"),
        float("inf"),
        float("-inf"),
        float("nan"),
    )
    args = (0.1,) if program is dense else ()
    out, lse = program(q, k, v, *args, return_lse=True)
    assert calls
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
def test_tensors_tma_cannot_address_run_the_generated_kernel(monkeypatch):
    calls = _spy(monkeypatch)
    flat = torch.randn(2 * 8 * 500 * 128 + 1, device="cuda", dtype=torch.float16)
    q = flat[1:].view(2, 8, 500, 128)  # 2 bytes past an aligned base
    k, v = (torch.randn(2, 8, 500, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    out = causal(q, k, v)
    assert not calls
    assert_matches_reference(
        out, causal.reference(q, k, v), causal.reference(q, k, v, dtype=torch.float16), torch.float16
    )
