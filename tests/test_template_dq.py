"""The Hopper dQ template's CPU-side logic (``attnfuse/kernels/dq.py``), with no GPU: it serves every program the
dK/dV template serves (``capability.dq_reason``), each served instance is complete Gluon that follows the masks'
key-block facts, how the backward chooses it (and when a call keeps the generated dQ kernel), and the tensors its
launcher takes. Its compile for sm90 is in ``tests/test_template_resources.py``; its numbers only a GPU checks
(``verify.backward_cases``, kind "dq")."""

from __future__ import annotations

import ast
import os

import attrs
import pytest
import torch

from attnfuse.kernels import capability, verified, verify
from attnfuse.kernels.dq_launch import TemplateDq
from attnfuse.kernels.tiles import DQ_TILES
from attnfuse.passes.compiler import compile as compile_plan
from attnfuse.passes.compiler import lowered
from attnfuse.plan import InputGradient, KernelConfig
from attnfuse.runtime import backward as runtime_backward
from attnfuse.runtime.compiled import compiled

from test_template import _undefined
from test_template_dkdv import SM90, _graph, _plan, packed_instance

from conftest import stand_in

HEAD_DIMS = tuple(DQ_TILES)


@pytest.mark.parametrize("variant", sorted(verify.VARIANTS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_dq_template_serves_every_variant(variant, dtype, head_dim):
    plan = _plan(variant, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim)
    assert "dq" in plan.templates.kernels and "dq" not in plan.templates.reasons
    spec = plan.templates.kernels["dq"]
    tiles = DQ_TILES[head_dim]
    assert spec.kind == "dq" and (spec.tiles.block_n, spec.tiles.num_stages) == (tiles.block_n, tiles.stages)
    assert spec.launch.constants == {"BLOCK_N": tiles.block_n, "STAGES": tiles.stages}


@pytest.mark.parametrize(
    "changes",
    [
        {"arch": "interpreter"},
        {"arch": "sm80"},
        {"dtype": "float32"},
        {"head_dim": 256, "head_dim_v": 256},
        {"head_dim": 96, "head_dim_v": 96},
        {"head_dim_v": 64},
        {"kv_lens": True},
        {"paged": True},
        {"positions": True},
        {"wide_positions": True},
        {"partial": True},
        {"varlen": True},
        {},
    ],
)
@pytest.mark.parametrize("variant", ["causal", "sinks", "additive_bias", "relu"])
def test_dq_serves_exactly_the_programs_the_dkdv_template_serves(variant, changes):
    """Same capability checks: where the dK/dV template falls back, the dQ template does, for the same cause."""
    kernel = lowered(_graph(variant), attrs.evolve(SM90, **changes))
    dkdv, dq = capability.dkdv_reason(kernel), capability.dq_reason(kernel)
    assert (dq is None) == (dkdv is None)
    if dq is not None:
        assert dq == dkdv.replace("dK/dV", "dQ")


@pytest.mark.parametrize("variant", sorted(verify.VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_dq_template_takes_dropout_where_the_dkdv_template_takes_it(variant, head_dim):
    """A call with attention dropout: the dQ template serves it exactly where the dK/dV template does (for the same
    reason where not); its step masks and scales dP, drawing the forward's numbers in the step's layout, before
    the normaliser's gradient; the GPU check's dropout cases are both templates'."""
    plan = _plan(variant, head_dim=head_dim, head_dim_v=head_dim, dropout=True)
    kernel = lowered(_graph(variant), plan.config)
    dkdv, dq = capability.dkdv_reason(kernel), capability.dq_reason(kernel)
    assert (dq is None) == (dkdv is None) and ("dq" in plan.templates.kernels) is (dq is None)
    if dq is not None:
        assert dq == dkdv.replace("dK/dV", "dQ")
        return
    source = plan.templates.kernels["dq"].source
    drawn = source.index("dp = gl.convert_layout(dp, S_LAYOUT, assert_trivial=True)")
    assert source.index("drop_seed = tl.load(DropoutState)") < source.index("for j in range(n_steps)") < drawn
    assert drawn < source.index("gradient of the scores")
    assert {c.kind for c in verify.backward_cases() if c.dropout} == {"dkdv", "dq"}


@pytest.mark.parametrize("variant", sorted(verify.VARIANTS))
def test_the_dq_template_takes_a_packed_call_where_the_forward_template_takes_it(variant):
    """Packed calls (cu_seqlens): the dQ template serves exactly the programs whose packed forward the forward
    template serves (not a tensor indexed by query and key, read by packed rows); with dropout or a listing mask
    it refuses them by name; its GPU cases are those programs' (``verify.backward_cases``)."""
    kernel = lowered(_graph(variant), attrs.evolve(SM90, varlen=True))
    forward, dq = capability.forward_reason(kernel), capability.dq_reason(kernel)
    assert (dq is None) == (forward is None)
    if dq is not None:  # a tensor indexed by query and key; a qk transform not hoisted (none is, packed)
        assert dq == forward.replace("forward template", "dQ template")
    dropout = capability.dq_reason(lowered(_graph(variant), attrs.evolve(SM90, varlen=True, dropout=True)))
    assert dropout is not None and (dq is not None or ("dropout" in dropout and "cu_seqlens" in dropout))
    packed = {c.variant for c in verify.backward_cases() if c.kind == "dq" and c.fact == "varlen"}
    assert (variant in packed) == (dq is None and variant != "sigmoid")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_a_packed_dq_instance_works_on_its_document_s_rows(head_dim):
    """A packed program finds its document from the grid (the packed forward's search), reads lse and delta at
    the document's rows of (1, HQ, total_q), loads Q, dO, K and V at packed rows (q_start, k_start added) and
    stores dQ and reads O at them, rows below the document's end only; its instance is complete Gluon."""
    source, entry, plain = packed_instance("dq", head_dim)
    assert entry.index("TOTAL_Q = Nq") < entry.index("if pid_m * BLOCK_M >= Nq:") < entry.index("q_lo = ")
    assert "row_base = pid_bh.to(tl.int64) * TOTAL_Q + q_start" in source
    assert "store_dq(dq, DQuery, dq_strides, b, h, q_start + first, q_start + Nq, G_LAYOUT)" in source
    assert "load_rows(O, o_desc, b, h, q_start + first, q_start + Nq," in source
    assert "bars, b, h, hk, q_start + m0, k_start + start," in source
    assert "q_start" not in plain and "TOTAL_Q" not in plain


@pytest.mark.parametrize("variant", sorted(verify.VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_served_dq_instances_splice_into_complete_gluon_text(variant, head_dim):
    source = _plan(variant, head_dim=head_dim, head_dim_v=head_dim).templates.kernels["dq"].source
    calls = [ast.unparse(n.func) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    assert not {"tl.full", "tl.zeros", "tl.arange"} & set(calls)
    assert _undefined(source) == []


def test_dq_instances_visit_the_key_blocks_the_masks_facts_give():
    """A masked program's key blocks come from its masks' kv_range / full_range facts, as the generated dQ
    kernel's; a dense one visits every block and masks only the partial last one."""
    window = _plan("sliding_window").templates.kernels["dq"].source
    assert "lo = tl.maximum(lo, q_lo" in window and "full_lo = tl.maximum(full_lo" in window
    dense = _plan("dense").templates.kernels["dq"].source
    assert "full_end = Nk // BLOCK_N * BLOCK_N" in dense and "q_lo -" not in dense


@pytest.mark.parametrize("variant", sorted(verify.VARIANTS))
def test_a_masked_step_zeroes_ds_past_the_keys_and_rows_and_on_masked_pairs(variant):
    """dS of a masked step is 0 on rows past Nq, on keys past Nk (TMA's zero rows: their weights are not 0)
    and on every mask's masked pairs, after the gradient chain and before dQ += dS·K."""
    source = _plan(variant).templates.kernels["dq"].source
    keep = next(line.strip() for line in source.splitlines() if line.strip().startswith("keep = "))
    assert keep.startswith("keep = q_ok[:, None] & k_ok[None, :]")
    body = source[source.index("if masked:") :]
    assert body.index("ds = tl.where(keep, ds, 0.0)") < body.index("ds = ds * sm_scale") < body.index("dq = ")


# ---------------------------------------------------------------------------------------------------------
# How the backward chooses it (whether it is opted in or recorded: test_template_dkdv.py, for both kinds)


@pytest.fixture
def recorder(monkeypatch):
    """``TemplateDq``'s stand-in: its constructions recorded instead of compiled."""
    return stand_in(monkeypatch, runtime_backward, "TemplateDq")


def test_a_call_that_wants_a_tensor_inputs_gradient_keeps_the_generated_dq_kernel(recorder, monkeypatch):
    """The generated dQ kernel writes the score-shaped gradient of a tensor input (an additive bias's), which
    the dQ template does not: a backward asked for it runs no dQ instance; one that is not, does."""
    monkeypatch.setenv(verified.MODE_ENV, "all")
    plan = _plan("additive_bias")
    [wanted] = plan.input_gradients
    assert isinstance(wanted, InputGradient) and not wanted.sides
    assert isinstance(runtime_backward.BackwardKernels(plan, ()).dq_template, recorder)
    assert runtime_backward.BackwardKernels(plan, (wanted,)).dq_template is None


def test_cpu_backwards_have_no_dq_template(monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, "all")
    config = KernelConfig(
        arch="interpreter", dtype="float32", head_dim=16, head_dim_v=16, group=1, save_lse=True, fp32_precision="ieee"
    )
    plan = compile_plan(_graph("causal"), config)
    assert "dq" not in plan.templates.kernels and "interpreter" in plan.templates.reasons["dq"]
    assert compiled(_graph("causal"), config).backward().dq_template is None


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_dq_launcher_takes_the_tensors_tma_can_address(head_dim):
    """``TemplateDq.fits``: lse where the normaliser saves one, a unit last stride of dq, TMA-addressable q, k, v,
    out and dout."""
    plan = _plan("causal", head_dim=head_dim, head_dim_v=head_dim)
    spec = plan.templates.kernels["dq"]
    key = verified.record_key(spec, "bfloat16", head_dim)
    launcher = TemplateDq(spec, 1.0, 1.0, key, has_lse=True)
    q, k, v, out, dout, dq = (torch.randn(1, 2, 40, head_dim, dtype=torch.bfloat16) for _ in range(6))
    lse = torch.randn(1, 2, 40)
    assert launcher.fits(q, k, v, out, dout, lse, dq)
    assert not launcher.fits(q, k, v, out, dout, None, dq)  # the rows the instance reads
    assert not launcher.fits(q, k, v, out.transpose(2, 3), dout, lse, dq)  # out: read for delta
    assert not launcher.fits(q, k, v, out, dout[..., 1:], lse, dq)  # misaligned rows
    assert not launcher.fits(q, k, v, out, dout, lse, dq.transpose(2, 3))  # a last stride other than 1
    assert TemplateDq(spec, 1.0, 1.0, key, has_lse=False).fits(q, k, v, out, dout, None, dq)


def test_the_dq_instance_is_a_program_of_its_own_in_the_record():
    """Its record key is of kind dq, apart from the dK/dV instance of the same program: a GPU run verifies each
    on its own."""
    plan = _plan("causal")
    keys = {kind: verified.record_key(plan.templates.kernels[kind], "bfloat16", 128) for kind in ("dq", "dkdv")}
    assert keys["dq"].startswith("dq/") and keys["dq"].split("/")[1] != keys["dkdv"].split("/")[1]


def test_a_backward_case_runs_the_unverified_instances_of_its_own_kind_alone(monkeypatch):
    """verify's dK/dV case runs an unverified dQ instance nowhere (and a dQ case no unverified dK/dV one): inside
    the case the mode lists the forward and the case's kind, with every cached choice dropped on the way in and
    out; afterwards the GPU check's mode is back."""
    record = verified
    cleared = []
    monkeypatch.setattr(verify, "clear_cache", lambda: cleared.append(os.environ.get(record.MODE_ENV)))
    monkeypatch.setenv(record.MODE_ENV, "all")
    monkeypatch.setattr(record, "is_verified", lambda key: False)
    for kind, other in (("dkdv", "dq"), ("dq", "dkdv")):
        cleared.clear()
        with verify._only_unverified(kind):
            assert record.chosen(f"{kind}/x/bfloat16/128") and record.chosen("forward/x/bfloat16/128")
            assert not record.chosen(f"{other}/x/bfloat16/128")
        assert os.environ[record.MODE_ENV] == "all" and cleared == ["all", "all"]
