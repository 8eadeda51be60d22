"""The Hopper dK/dV template's CPU-side logic (``attnfuse/kernels/dkdv.py``), with no GPU: which programs it
serves (``capability.dkdv_reason``), that each served instance is complete Gluon that compiles for sm90 within
an H100/H200 block's shared memory, how the backward chooses it, the rows it reads, and the GPU check's
gradient comparison (``verify.compare_gradients``), run here on the generated kernels."""

from __future__ import annotations

import ast
import math
import re

import attrs
import pytest
import torch
import triton

import attnfuse as af
from attnfuse.combinator import Combinator, MaskFragment, Role, ScoreModFragment
from attnfuse.kernels import capability, verified, verify
from attnfuse.kernels.launch import TemplateDkdv
from attnfuse.kernels.pipeline import LAUNCH_REGISTERS
from attnfuse.kernels.tiles import DKDV_TILES, SHARED_MEMORY_LIMIT
from attnfuse.launch_spec import CONSTEXPR, SCALAR, TENSOR
from attnfuse.passes.compiler import compile as compile_plan
from attnfuse.passes.compiler import lowered
from attnfuse.plan import KernelConfig
from attnfuse.runtime import backward as runtime_backward
from attnfuse.runtime import hopper
from attnfuse.runtime.template_rows import padded_rows, template_rows

from test_template import _undefined

from conftest import stand_in

SM90 = KernelConfig(
    arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, group=2, save_lse=True, fp32_precision="ieee"
)
HEAD_DIMS = tuple(DKDV_TILES)


def _graph(variant: str):
    program, extra = verify.VARIANTS[variant]
    return program.graph(**extra(4, 48, 64, "cpu"))


def _plan(variant: str, **changes):
    """The plan a call of ``variant`` runs its dK/dV kernel from (the hoisted one where it hoists)."""
    graph = _graph(variant)
    config = attrs.evolve(SM90, save_lse=graph.has_lse, **changes)
    return compile_plan(graph, compile_plan(graph, config).hoisted_config)


# ---------------------------------------------------------------------------------------------------------
# 1. Which programs it serves


@pytest.mark.parametrize("variant", sorted(verify.VARIANTS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_dkdv_template_serves_every_variant(variant, dtype, head_dim):
    plan = _plan(variant, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim)
    assert "dkdv" in plan.templates.kernels and "dkdv" not in plan.templates.reasons
    spec = plan.templates.kernels["dkdv"]
    assert spec.kind == "dkdv" and spec.tiles.num_stages == DKDV_TILES[head_dim].stages


@pytest.mark.parametrize(
    "changes,cause",
    [
        ({"arch": "interpreter"}, "interpreter"),
        ({"arch": "sm80"}, "sm80"),
        ({"dtype": "float32"}, "float32"),
        ({"head_dim": 256, "head_dim_v": 256}, "256"),
        ({"head_dim": 96, "head_dim_v": 96}, "96"),
        ({"head_dim_v": 64}, "D == DV (got 128 and 64)"),
        ({"kv_lens": True}, "kv_lens"),
        ({"paged": True}, "paged"),
        ({"positions": True}, "positions"),
        ({"wide_positions": True}, "2**30"),
        ({"partial": True}, "partial"),
    ],
)
@pytest.mark.parametrize("variant", ["causal", "sigmoid" if "sigmoid" in verify.VARIANTS else "relu"])
def test_dkdv_reason_names_what_the_template_does_not_take(variant, changes, cause):
    graph = _graph(variant)
    assert capability.dkdv_reason(lowered(graph, SM90)) is None
    reason = capability.dkdv_reason(lowered(graph, attrs.evolve(SM90, **changes)))
    assert reason is not None and cause in reason
    if changes.get("kv_lens"):
        assert "dK/dV template" in reason


def _softmax_like(name: str, **changes) -> Combinator:
    """softmax with ``changes`` to its fragment (a test plugin)."""
    softmax = af.combinators()["softmax"].combinator
    return Combinator(
        name=name,
        role=Role.NORMALISER,
        doc="softmax, with a backward of its own (a test plugin).",
        reference=softmax.reference,
        fragment=attrs.evolve(softmax.fragment, **changes),
    )


NO_GRAD = _softmax_like("_test_dkdv_no_grad", grad=None)
DELTA_NO_LSE = _softmax_like(  # its rows' statistics from elsewhere: delta without lse
    "_test_dkdv_delta_no_lse",
    has_lse=False,
    finalize="l_use = tl.where(l_i == 0.0, 1.0, l_i)\nout = acc / l_use[:, None]",
    backward_rows="",
    recompute="p = tl.math.exp2(s)",
    combine=None,
    partial=None,
)
NO_GRAD_MOD = Combinator(
    name="_test_dkdv_mod_no_grad",
    role=Role.SCORE_MOD,
    doc="s + 1 with no backward (a test plugin).",
    reference=lambda s, ctx: s + 1.0,
    fragment=ScoreModFragment(body="s = s + 1.0", grad=None),
)


def _plus_one(s):
    return af._test_dkdv_mod_no_grad(s)


class _Plugin:
    def __init__(self, combinator: Combinator):
        self.combinator = combinator

    @af.hookimpl
    def attnfuse_combinators(self):
        return [self.combinator]


@pytest.fixture
def third_party():
    names = []
    try:
        for comb in (NO_GRAD, DELTA_NO_LSE, NO_GRAD_MOD):
            af.register_plugin(_Plugin(comb), name=f"dkdv-test:{comb.name}")
            names.append(f"dkdv-test:{comb.name}")
        yield
    finally:
        for name in reversed(names):
            af.unregister_plugin(name)


@pytest.mark.parametrize(
    "build,cause",
    [
        (lambda: af.attention(lambda q, k, v: af._test_dkdv_no_grad(af.scaled_dot_product(q, k)) @ v), "no backward"),
        (
            lambda: af.attention(lambda q, k, v: af._test_dkdv_delta_no_lse(af.scaled_dot_product(q, k)) @ v),
            "needs delta but saves no lse",
        ),
        (
            lambda: af.attention(
                lambda q, k, v: af.softmax(af._test_dkdv_mod_no_grad(af.scaled_dot_product(q, k))) @ v
            ),
            "no backward",
        ),
    ],
    ids=["normaliser-without-grad", "delta-without-lse", "modification-without-grad"],
)
def test_dkdv_reason_refuses_what_has_no_template_backward(third_party, build, cause):
    """A third party's program the template cannot differentiate falls back, with the combinator named."""
    graph = build().graph()
    reason = capability.dkdv_reason(lowered(graph, SM90))
    assert reason is not None and cause in reason and "_test_dkdv_" in reason
    assert "dkdv" not in compile_plan(graph, SM90).templates.kernels


# ---------------------------------------------------------------------------------------------------------
# 2. Each served instance is complete Gluon that compiles for sm90


@pytest.mark.parametrize("variant", sorted(verify.VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_served_dkdv_instances_splice_into_complete_gluon_text(variant, head_dim):
    source = _plan(variant, head_dim=head_dim, head_dim_v=head_dim).templates.kernels["dkdv"].source
    calls = [ast.unparse(n.func) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    assert not {"tl.full", "tl.zeros", "tl.arange"} & set(calls)
    assert _undefined(source) == []


MASKED = sorted(v for v in verify.VARIANTS if v not in ("dense", "additive_bias"))  # the variants with a mask


@pytest.mark.parametrize("variant", MASKED)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_masked_instances_at_head_dim_128_store_a_step_s_keep_before_its_products(variant, head_dim):
    """At head dim 128 a masked step evaluates its keep (rows below Nq, the masks' own) into shared memory before
    its products, its keys computed in the step, and the chain reads it there (``kernels/dkdv_keep.py``); at 64
    the chain evaluates it beside the scores, the keys computed once."""
    source = _plan(variant, head_dim=head_dim, head_dim_v=head_dim).templates.kernels["dkdv"].source
    tree = ast.parse(source)
    consumer = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_consumer"))
    loop = next(n for n in consumer.body if isinstance(n, ast.For))
    masked = [ast.unparse(n) for n in loop.body if isinstance(n, ast.If) and ast.unparse(n.test) == "masked"]
    chain = next(n for n in ast.walk(loop) if isinstance(n, ast.If) and "p = tl.where(keep, p, 0.0)" in ast.unparse(n))
    keys = [ast.unparse(n) for n in loop.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "k_idx"]
    functions = {n.name.rsplit("_", 1)[-1]: ast.unparse(n) for n in tree.body if isinstance(n, ast.FunctionDef)}
    if head_dim == 128:
        assert len(masked) == 2 and "_keep(keep_tile, start_m, opaque(n0 + HALF_ID * BLOCK_N)" in masked[0]
        assert "keep = keep_tile.load(S_LAYOUT) != 0" in ast.unparse(chain) and len(keys) == 1
        assert (
            "keep_tile.slice(part * BLOCK_M, BLOCK_M).store" in functions["keep"]
            and "q_ok[:, None] &" in functions["keep"]
        )
    else:
        assert len(masked) == 1 and "keep = q_ok[:, None] &" in ast.unparse(chain) and not keys
        assert "keep" not in functions


def _compile(spec, head_dim: int, group_sum: str):
    """``spec``'s instance compiled for sm90 (bfloat16 tensors), as a launch would compile it."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from attnfuse.runtime.source_cache import load_function, write_source

    fn = load_function(spec.source, spec.name, write_source(spec.name, spec.source))
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, 64, head_dim], gl.bfloat16)
    tile = f"tensordesc<bf16[1, 1, 64, {head_dim}],{layout!r}>"
    rows = f"tensordesc<fp32[64],{hopper._ROW_LAYOUT!r}>"
    reads_rows = "lse_smem = gl.allocate" in spec.source
    named = {n: tile for n in ("q_desc", "do_desc", "k_desc", "v_desc")}
    named |= {"DKey": "*bf16", "DValue": "*bf16", "dk_part": "*fp32", "dv_part": "*fp32", "counts": "*i32"}
    signature, constants = {}, {**spec.launch.constants, "GROUP_SUM": group_sum}
    for p in spec.launch.params:
        if p.name in ("lse_desc", "delta_desc"):
            signature[p.name] = rows if reads_rows else "constexpr"
            if not reads_rows:
                constants[p.name] = None
        else:
            kinds = {CONSTEXPR: "constexpr", SCALAR: "fp32", TENSOR: "*fp32"}
            signature[p.name] = named.get(p.name) or kinds.get(p.kind, "i32")
    return triton.compile(
        GluonASTSource(fn, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "maxnreg": LAUNCH_REGISTERS},
    )


@pytest.mark.parametrize("variant", sorted(verify.DROPOUT_VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_dropout_instances_regenerate_a_step_s_mask_into_shared_memory(variant, head_dim):
    """With attention dropout a step regenerates the forward's mask into shared memory before its products,
    reading the seed and offset there, and the chain reads the mask back (``kernels/dkdv_dropout.py``); a masked
    step stores its keep too (``dkdv_keep``)."""
    source = _plan(variant, head_dim=head_dim, head_dim_v=head_dim, dropout=True).templates.kernels["dkdv"].source
    tree = ast.parse(source)
    functions = {n.name.rsplit("_", 1)[-1]: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    loop = next(n for n in functions["consumer"].body if isinstance(n, ast.For))
    calls = [ast.unparse(n) for n in loop.body if isinstance(n, ast.Expr)]
    assert any(
        c.startswith(f"{functions['drop'].name}(drop_tile, start_m, opaque(n0 + HALF_ID * BLOCK_N)") for c in calls
    )
    assert "drop_keep = drop_tile.load(S_LAYOUT) != 0" in ast.unparse(loop) and "_keep(keep_tile" in ast.unparse(loop)
    assert "drop_seed" not in ast.unparse(functions["consumer"])
    drop = ast.unparse(functions["drop"])
    assert "drop_seed = tl.load(DropoutState)" in drop and "drop_w0 & 65535 >= drop_limit" in drop
    assert "gl.convert_layout(drop_keep, PART, assert_trivial=True)" in drop  # whole groups: nothing moves


EVEN_KEYS = Combinator(  # a keep that builds a tile from nothing, as fragments may
    name="_test_dkdv_even_keys",
    role=Role.MASK,
    doc="Keeps the even keys (a test plugin).",
    reference=lambda ctx: ctx.k_pos % 2 == 0,
    fragment=MaskFragment(keep="(tl.zeros([BLOCK_M, BLOCK_N], tl.int32) + k_pos[None, :]) % 2 == 0"),
)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_a_keep_that_builds_a_tile_compiles_where_the_step_stores_it(head_dim):
    """A mask fragment's ``tl.zeros([BLOCK_M, BLOCK_N])`` is the step's tile in the chain and the part's (8 x 64)
    where a masked step stores its keep (``dkdv_keep``): the instance defines every name and compiles."""
    af.register_plugin(_Plugin(EVEN_KEYS), name="dkdv-test:even-keys")
    try:
        program = af.attention(lambda q, k, v: af.softmax(af._test_dkdv_even_keys(af.scaled_dot_product(q, k))) @ v)
        graph = program.graph()
        config = attrs.evolve(SM90, save_lse=True, head_dim=head_dim, head_dim_v=head_dim)
        spec = compile_plan(graph, config).templates.kernels["dkdv"]
        assert ("_keep(keep_tile" in spec.source) == (head_dim == 128)
        assert _undefined(spec.source) == []
        assert "wgmma.mma_async" in _compile(spec, head_dim, "none").asm["ptx"]
    finally:
        af.unregister_plugin("dkdv-test:even-keys")


@pytest.mark.parametrize("variant", sorted(verify.VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_dkdv_instances_compile_for_sm90_within_shared_memory(variant, head_dim):
    spec = _plan(variant, head_dim=head_dim, head_dim_v=head_dim).templates.kernels["dkdv"]
    compiled = _compile(spec, head_dim, "none")
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT


@pytest.mark.parametrize("group_sum", ["atomic", "last"])
def test_dkdv_instances_sum_a_split_group_as_told(group_sum):
    compiled = _compile(_plan("causal").templates.kernels["dkdv"], 128, group_sum)
    ptx = compiled.asm["ptx"]
    assert ("atom.global.gpu.relaxed.add.f32" in ptx) == (group_sum == "atomic")  # the shares' adds
    assert ("atom.global.gpu.acq_rel.add" in ptx) == (group_sum == "last")  # their count
    assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT


def test_dkdv_instances_visit_the_query_blocks_the_masks_facts_give():
    """A masked program's query blocks come from its masks' q_range / q_full_range facts; a dense one visits
    every block and masks only the partial ones."""
    window = _plan("sliding_window").templates.kernels["dkdv"].source
    assert re.search(r"lo = tl\.maximum\(lo, .*k_lo", window) and "full_lo = tl.maximum(full_lo" in window
    dense = _plan("dense").templates.kernels["dkdv"].source
    assert "full_end = Nq // BLOCK_M * BLOCK_M" in dense and "k_lo -" not in dense


# ---------------------------------------------------------------------------------------------------------
# 3. How the backward chooses it


BACKWARD_KINDS = {  # each backward template: the class that launches it and the function choosing it
    "dkdv": ("TemplateDkdv", runtime_backward.template_dkdv),
    "dq": ("TemplateDq", runtime_backward.template_dq),
}


@pytest.mark.parametrize("kind", list(BACKWARD_KINDS))
@pytest.mark.parametrize("variant", ["causal", "sinks", "rope_causal"])
def test_an_unrecorded_backward_instance_runs_only_when_opted_in(kind, variant, record, monkeypatch):
    cls, choose = BACKWARD_KINDS[kind]
    recorder = stand_in(monkeypatch, runtime_backward, cls)
    plan = _plan(variant)
    spec = plan.templates.kernels[kind]
    key = verified.record_key(spec, plan.config.dtype, plan.config.head_dim)
    assert key.startswith(f"{kind}/")
    record([])
    for mode in ("verified", "off"):
        monkeypatch.setenv(verified.MODE_ENV, mode)
        assert choose(plan) is None
    assert recorder.made == []
    monkeypatch.setenv(verified.MODE_ENV, "all")
    assert isinstance(choose(plan), recorder)
    assert recorder.made == [(spec, plan.templates.scale, plan.templates.qk_scale, key, plan.has_lse)]


@pytest.mark.parametrize("kind", list(BACKWARD_KINDS))
def test_a_recorded_backward_instance_runs_by_default(kind, record, monkeypatch):
    cls, choose = BACKWARD_KINDS[kind]
    recorder = stand_in(monkeypatch, runtime_backward, cls)
    monkeypatch.delenv(verified.MODE_ENV, raising=False)
    plan = _plan("causal")
    spec = plan.templates.kernels[kind]
    record([verified.record_key(spec, "float16", 128)])  # another dtype's instance of the same source
    assert choose(plan) is None
    record([verified.record_key(spec, "bfloat16", 128)])
    assert isinstance(choose(plan), recorder)


def test_cpu_backwards_have_no_dkdv_template(monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, "all")
    from attnfuse.runtime.compiled import compiled

    config = KernelConfig(
        arch="interpreter", dtype="float32", head_dim=16, head_dim_v=16, group=1, save_lse=True, fp32_precision="ieee"
    )
    plan = compile_plan(_graph("causal"), config)
    assert "dkdv" not in plan.templates.kernels and "interpreter" in plan.templates.reasons["dkdv"]
    assert compiled(_graph("causal"), config).backward().template is None


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_launcher_takes_the_tensors_tma_can_address(head_dim):
    """``TemplateDkdv.fits``: lse where the normaliser saves one, unit last strides, TMA-addressable inputs."""
    plan = _plan("causal", head_dim=head_dim, head_dim_v=head_dim)
    key = verified.record_key(plan.templates.kernels["dkdv"], "bfloat16", head_dim)
    launcher = TemplateDkdv(plan.templates.kernels["dkdv"], 1.0, 1.0, key, has_lse=True)
    q, k, v, dout, dk, dv = (torch.randn(1, 2, 40, head_dim, dtype=torch.bfloat16) for _ in range(6))
    lse = torch.randn(1, 2, 40)
    assert launcher.fits(q, k, v, dout, lse, dk, dv)
    assert not launcher.fits(q, k, v, dout, None, dk, dv)  # the rows the instance reads
    assert not launcher.fits(q, k, v.transpose(2, 3), dout, lse, dk, dv)  # a last stride other than 1
    assert not launcher.fits(q, k, v, dout, lse, dk, dv.transpose(2, 3))
    no_lse = TemplateDkdv(plan.templates.kernels["dkdv"], 1.0, 1.0, key, has_lse=False)
    assert no_lse.fits(q, k, v, dout, None, dk, dv)


# ---------------------------------------------------------------------------------------------------------
# 4. The rows it reads, and how a split group sums


@pytest.mark.parametrize("natural", [False, True])
def test_template_rows_give_lse_as_saved_or_in_log2_units(natural):
    B, H, Nq = 2, 3, 37
    lse = torch.randn(B, H, Nq) * 4
    lse[0, 1, 5] = -math.inf  # a row that keeps no key
    delta = torch.randn(B, H, Nq)
    lse_rows, delta_rows = template_rows(lse, 64, delta=delta, natural=natural)
    padded = padded_rows(Nq, 64)
    got = lse_rows.view(B, H, padded)
    want = lse if natural else torch.where(lse == -math.inf, math.inf, lse * math.log2(math.e))
    torch.testing.assert_close(got[..., :Nq], want)
    assert torch.all(got[..., Nq:] == (-math.inf if natural else math.inf))
    torch.testing.assert_close(delta_rows.view(B, H, padded)[..., :Nq], delta)


@pytest.mark.parametrize("parts,deterministic,want", [(1, False, "none"), (2, False, "last"), (4, False, "atomic"),
                                                      (4, True, "last")])  # fmt: skip
def test_group_split_sums_the_group_s_parts(monkeypatch, parts, deterministic, want):
    from conftest import deterministic_algorithms

    import contextlib

    monkeypatch.setattr(hopper, "_group_parts", lambda programs, group, device: parts)
    q, dk, dv = torch.randn(2, 8, 40, 64), torch.randn(2, 2, 300, 64), torch.randn(2, 2, 300, 64)
    with deterministic_algorithms() if deterministic else contextlib.nullcontext():
        got, group_sum, dk_part, dv_part, counts = hopper.group_split(q, dk, dk, dv)
    assert (got, group_sum) == (parts, want)
    if want == "none":
        assert dk_part is dk and dv_part is dv
    elif want == "last":
        assert dk_part.shape == (parts, 2, 2, 300, 64) and torch.all(counts == 0)
        assert counts.numel() == 2 * 2 * 2 * triton.cdiv(300, 128)
    else:
        assert dk_part.shape == dv_part.shape == (2, 2, 300, 64) and torch.all(dk_part == 0)


# ---------------------------------------------------------------------------------------------------------
# 5. The GPU check's cases and gradient comparison


@pytest.mark.parametrize("kind", ["dkdv", "dq"])
def test_backward_cases_cover_every_variant_head_dim_and_dtype(kind):
    found = [c for c in verify.backward_cases() if c.kind == kind]
    assert "relu" in verify.VARIANTS and not verify.smooth("relu")  # its cases draw exact scores
    assert {(c.variant, c.head_dim, c.dtype) for c in found} == {
        (v, d, t) for v in verify.FORWARD_VARIANTS for d in HEAD_DIMS for t in verify.DTYPES
    }  # the listed variants included
    assert not any(c.poison for c in found)
    assert {c.kind for c in verify.backward_cases()} == {"dkdv", "dq"}
    ids = [c.id for c in verify.backward_cases() + verify.cases()]
    assert len(set(ids)) == len(ids)
    assert any(c.shape[1] > c.shape[2] for c in found) and any(c.shape[3] % 64 for c in found)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_exact_scores_are_exact_and_never_zero(dtype, head_dim):
    """``verify.exact_scores``: q and k as the dtype holds them, whose float32 products equal float64's and are
    never 0, so a kernel keeps every score on relu's side of 0 that the float64 reference keeps it on."""
    gen = torch.Generator().manual_seed(head_dim)
    q, k = (torch.randn(2, 3, n, head_dim, generator=gen).to(dtype) for n in (70, 90))
    q, k = verify.exact_scores(q, k)
    assert q.dtype == k.dtype == dtype
    scores32 = q.float() @ k.float().transpose(-1, -2)
    scores64 = q.double() @ k.double().transpose(-1, -2)
    assert torch.equal(scores32.double(), scores64) and (scores64.abs() >= 0.5).all()
    assert len(torch.unique(scores64)) > 100  # spread over many values, not a constant


@pytest.mark.parametrize("variant", ["causal", "sinks", "causal_alibi"])
def test_compare_gradients_passes_a_right_backward_and_fails_a_wrong_one(variant):
    """The comparison the GPU check makes, run here on the generated kernels' float16 gradients: it passes
    them, and fails them once dk is off by 5% of its size."""
    program, extra = verify.VARIANTS[variant]
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 40, 56, 16
    kwargs = extra(Hq, Nq, Nk, "cpu")
    q, k, v = (torch.randn(B, h, n, D).to(torch.float16) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))
    dout = torch.randn(B, Hq, Nq, D).to(torch.float16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    got = torch.autograd.grad(program(*leaves, **kwargs), leaves, dout)
    error = verify.compare_gradients(program, kwargs, (q, k, v), dout, got, variant)
    assert 0.0 < error < 0.1
    dq, dk, dv = got
    wrong = dk + 0.05 * dk.abs().max() * torch.randn_like(dk).sign()
    with pytest.raises(AssertionError, match="dk of"):
        verify.compare_gradients(program, kwargs, (q, k, v), dout, (dq, wrong, dv), variant)


@pytest.mark.parametrize("variant", verify.DROPOUT_VARIANTS)
def test_compare_gradients_replays_the_calls_dropout_mask(variant):
    """The dropout cases' comparison, run here on the generated kernels' float16 gradients with dropout: it
    passes them against the reference replaying the call's mask, and fails them against another mask."""
    program, extra = verify.VARIANTS[variant]
    B, Hq, Hkv, Nq, Nk, D, p = 1, 2, 1, 40, 56, 16, verify.DROPOUT_P
    kwargs = extra(Hq, Nq, Nk, "cpu")
    q, k, v = (torch.randn(B, h, n, D).to(torch.float16) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))
    dout = torch.randn(B, Hq, Nq, D).to(torch.float16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    case = verify.Case(variant, D, "float16", (B, Hq, Hkv, Nq, Nk), False, kind="dkdv", dropout=p)
    with verify.replayed_dropout(case, 5, (B, Hq, Nq, Nk), q.device) as (dropout, replayed):
        got = torch.autograd.grad(program(*leaves, **kwargs, **dropout), leaves, dout)
    assert dropout == {"dropout_p": p} and not replayed["dropout_mask"].all()
    error = verify.compare_gradients(program, kwargs, (q, k, v), dout, got, variant, replayed)
    assert 0.0 < error < 0.1
    other = {**replayed, "dropout_mask": af.dropout_keep(af.dropout_state("cpu"), p, (B, Hq, Nq, Nk))}
    with pytest.raises(AssertionError, match=rf"d[qkv] of {variant}"):
        verify.compare_gradients(program, kwargs, (q, k, v), dout, got, variant, other)


@pytest.mark.parametrize("variant", ["causal", "sinks"])
def test_compare_gradients_of_a_packed_call_keeps_each_document_to_itself(variant, monkeypatch):
    """The packed cases' comparison (``documents``: ``packed_reference``, each of ``DOCUMENTS`` attending within
    itself, an empty one and one with no key among them), run here on the generated kernels' float16 gradients of a
    packed call: it passes them, and fails them against the reference of the whole row as one sequence."""
    documents = ((0, 3), (5, 5), (17, 9), (4, 0), (20, 31))
    monkeypatch.setattr(verify, "DOCUMENTS", documents)
    program, extra = verify.VARIANTS[variant]
    Hq, Hkv, D = 2, 1, 16
    Nq, Nk = (sum(n[i] for n in documents) for i in (0, 1))
    kwargs = extra(Hq, Nq, Nk, "cpu")
    q, k, v = (torch.randn(1, h, n, D).to(torch.float16) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))
    dout = torch.randn(1, Hq, Nq, D).to(torch.float16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    facts = verify.fact_arguments("varlen", q.device)
    got = torch.autograd.grad(program(*leaves, **kwargs, **facts), leaves, dout)
    error = verify.compare_gradients(program, kwargs, (q, k, v), dout, got, variant, documents=True)
    assert 0.0 < error < 0.1
    with pytest.raises(AssertionError, match=rf"d[qkv] of {variant}"):
        verify.compare_gradients(program, kwargs, (q, k, v), dout, got, variant)


def packed_instance(kind: str, head_dim: int) -> tuple[str, str, str]:
    """The ``kind`` instance of a packed causal call, checked to take the pack's arguments and to be complete Gluon:
    its source, its entry function's, and the source of the unpacked call's instance."""
    spec = _plan("causal", head_dim=head_dim, head_dim_v=head_dim, varlen=True).templates.kernels[kind]
    assert {"CuQ", "CuK", "DOCS", "SEARCH_STEPS"} <= {p.name for p in spec.launch.params}
    assert _undefined(spec.source) == []
    plain = _plan("causal", head_dim=head_dim, head_dim_v=head_dim).templates.kernels[kind].source
    return spec.source, spec.source[spec.source.index(f"def {spec.name}(") :], plain


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_a_packed_dkdv_instance_works_on_its_document_s_rows(head_dim):
    """A packed program finds its document from the grid (its key block, as the generated packed dK/dV kernel
    finds it), its loader reads K, V, Q and dO at the document's packed rows (q_start, k_start), lse and delta from
    the document's block-aligned start (``launch_packed.document_rows``), and it stores dK and dV at its packed
    rows, keys below the document's end only; its instance is complete Gluon."""
    source, entry, plain = packed_instance("dkdv", head_dim)
    assert entry.index("TOTAL_K = N_K") < entry.index("if pid_n * BLOCK_N >= N_K:") < entry.index("k_lo = n0")
    assert "n_qblocks, n_iter, q_start, k_start, rows_start, row_stride" in entry
    assert "rows_start = (q_start + doc * BLOCK_M) // BLOCK_M * BLOCK_M" in entry
    assert "key = gl.expand_dims(k_start + n0 + HALF_ID * BLOCK_N" in source and "k_start + Nk, heads" in source
    assert "n_qblocks, n_iter, 0, 0, 0, row_stride" in plain and "k_start" not in plain
