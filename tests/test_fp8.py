"""Float8 calls (q, k, v in float8_e4m3fn or float8_e5m2 with FlashAttention-3's descales): programs against
the float64 reference of the dequantised inputs, at tolerances derived below, and every refusal.

Why the tolerances are what they are. The inputs are exact after dequantisation (q_raw · q_descale is what
the reference computes with), and float8 values are exact in float16, bfloat16 and float32, so:

- q·kᵀ: each product of two float8 values is exact in float32 (4 + 4 significant bits at most); the sum over
  D, the descale multiply and everything up to the weights are float32 arithmetic, as in a float32 call:
  covered by the float32 floor of ``assert_matches_reference`` (twice the naive float32 evaluator's error on
  the same dequantised inputs, plus its ATOL). On a GPU the tensor cores sum float8 products in a narrower
  accumulator first: ``test_on_a_gpu`` adds that term (``ACCUMULATOR_ROUNDOFF``).
- P·V: P is rounded to UPCAST_DTYPE before the product (float16 under the interpreter, unit roundoff
  u_p = 2⁻¹¹; bfloat16 on a GPU, 2⁻⁸), v is exact there, the sum is float32 and the normaliser's sums take
  the unrounded P. Each weight w_j (≥ 0 for every normaliser tested) is off by at most u_p · w_j, so out is
  off by at most u_p · Σ_j w_j |v_j| = u_p · (the reference's out for |v|).
- out is rounded to out_dtype: float32 (in the floor), float16 (u = 2⁻¹¹), bfloat16 (2⁻⁸ on a GPU; 2⁻⁷ under
  Triton 3.6's interpreter, which truncates float32 to bfloat16 instead of rounding to nearest): at most
  u_out · (|ref| + the P·V bound).
"""

from __future__ import annotations

import json
import math
import re

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.errors import DeclarationError
from attnfuse.passes.compiler import lowered
from attnfuse.kernels.capability import forward_reason
from attnfuse.kernels import verified
from attnfuse.plan import KernelConfig
from attnfuse.runtime import fp8 as fp8_module
from attnfuse.runtime.launch import clear_cache, planned
from attnfuse.testing import assert_matches_reference

from conftest import requires_cuda

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
B, HQ, HKV, D = 2, 4, 2, 16
P_ROUNDOFF = {"cpu": 2.0**-11, "cuda": 2.0**-8}  # UPCAST_DTYPE: float16 under the interpreter, else bfloat16
OUT_ROUNDOFF = {
    "cpu": {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-7},  # bfloat16 truncated
    "cuda": {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8},
}


def quantised(x: torch.Tensor, dtype: torch.dtype, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, N, D) scaled into ``dtype``'s range and rounded to it, with its descale: (B, Hkv) per kv head
    (the query heads of a group sharing one), else (1,); a random factor in [1, 2) so that no descale is the
    plain amax / max."""
    groups = x.shape[1] // HKV
    amax = x.abs().amax(dim=(2, 3)).view(x.shape[0], HKV, groups).amax(-1) if per_head else x.abs().amax().view(1)
    descale = (amax / torch.finfo(dtype).max * (1 + torch.rand(amax.shape))).float()  # in range: |x| <= max
    scale = descale.repeat_interleave(groups, dim=1)[:, :, None, None] if per_head else descale
    return (x / scale).to(dtype), descale


def fp8_inputs(
    dtype: torch.dtype, per_head: bool, Nq: int = 40, Nk: int = 40, device: str = "cpu", head_dim: int = D
) -> tuple[list, dict]:
    """Fresh random q, k, v quantised to ``dtype``, and their descales by argument name."""
    q, qd = quantised(torch.randn(B, HQ, Nq, head_dim), dtype, per_head)
    k, kd = quantised(torch.randn(B, HKV, Nk, head_dim), dtype, per_head)
    v, vd = quantised(torch.randn(B, HKV, Nk, head_dim), dtype, per_head)
    moved = [t.to(device) for t in (q, k, v)]
    return moved, {"q_descale": qd.to(device), "k_descale": kd.to(device), "v_descale": vd.to(device)}


def check(program, qkv, descales, out_dtype=None, extra=(), score_error=0.0, **call):
    """The call (out and lse) against the float64 reference, within the bounds derived in the module's doc;
    ``score_error``: a bound on each score's error beyond float32's, which moves each weight by a factor
    within e^(±2 score_error) and out by at most (e^(2 score_error) - 1) Σ_j w_j |v_j|."""
    q, k, v = qkv
    given = {} if out_dtype is None else {"out_dtype": out_dtype}
    lse = program.graph(*extra).has_lse
    got = program(q, k, v, *extra, **descales, **given, **call, return_lse=lse)
    out, got_lse = got if lse else (got, None)
    assert out.dtype == (out_dtype or torch.bfloat16)
    assert_within_bounds(program, qkv, descales, out, got_lse, extra, score_error, **call)


def assert_within_bounds(program, qkv, descales, out, lse=None, extra=(), score_error=0.0, **call):
    """``out`` (and ``lse``, where given) of a float8 call on ``qkv`` against the float64 reference, within the
    bounds derived in the module's doc (``check``)."""
    q, k, v = qkv
    results = [
        program.reference(q, k, v, *extra, **descales, **call, return_lse=lse is not None),
        program.reference(q, k, v, *extra, **descales, **call, return_lse=lse is not None, dtype=torch.float32),
    ]
    (ref, naive), lses = zip(*results) if lse is not None else (results, None)
    v_abs = v.float().abs().to(v.dtype)  # exact
    pv = (P_ROUNDOFF[q.device.type] + math.expm1(2 * score_error)) * program.reference(
        q, k, v_abs, *extra, **descales, **call
    )
    u_out = OUT_ROUNDOFF[q.device.type][out.dtype]
    assert_matches_reference(out, ref, naive, dtype=torch.float32, rounding=pv + u_out * (ref.abs() + pv))
    if lse is not None:  # lse = log Σ_j exp(s_j) moves by at most score_error
        assert lse.dtype == torch.float32
        bound = torch.full_like(lses[0], score_error)
        assert_matches_reference(lse, *lses, dtype=torch.float32, what="lse", rounding=bound)


@af.attention
def causal_softmax(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def alibi(q, k, v):
    return af.softmax(af.alibi(af.causal(af.scaled_dot_product(q, k)))) @ v


@af.attention
def softcapped(q, k, v):
    return af.softmax(af.softcap(af.scaled_dot_product(q, k, scale=0.5), cap=5.0)) @ v


@af.attention
def with_sinks(q, k, v, sinks):
    return af.softmax_with_sinks(af.sliding_window(af.scaled_dot_product(q, k), left=9), sinks) @ v


@af.attention
def relu(q, k, v):
    return af.relu_attention(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v


PROGRAMS = {  # each with its extra arguments for N queries and keys
    "causal": (causal_softmax, lambda n: ()),
    "alibi": (alibi, lambda n: ()),
    "softcap": (softcapped, lambda n: ()),
    "sinks": (with_sinks, lambda n: (torch.randn(HQ) * 2,)),
    "bias": (biased, lambda n: (torch.randn(B, 1, n, n),)),
}


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", PROGRAMS)
def test_programs_match_the_dequantised_reference(name, dtype):
    """Every program of the table, GQA (Hq = 4, Hkv = 2), per-head descales, out in float32."""
    program, extra = PROGRAMS[name]
    qkv, descales = fp8_inputs(dtype, per_head=True)
    check(program, qkv, descales, torch.float32, extra(40))


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("out_dtype", [None, torch.float16], ids=["default-bfloat16", "float16"])
def test_per_tensor_descales_and_out_dtypes(dtype, out_dtype):
    qkv, descales = fp8_inputs(dtype, per_head=False)
    check(causal_softmax, qkv, descales, out_dtype)


def test_relu_attention_weights_that_do_not_sum_to_one():
    qkv, descales = fp8_inputs(torch.float8_e4m3fn, per_head=True)
    check(relu, qkv, descales, torch.float32)


@pytest.mark.parametrize("Nq", [3, 40])
def test_kv_lens(Nq):
    """A KV cache's lengths (with few queries: decoding, which float8 runs in the forward kernel)."""
    qkv, descales = fp8_inputs(torch.float8_e5m2, per_head=True, Nq=Nq, Nk=48)
    check(causal_softmax, qkv, descales, torch.float32, kv_lens=torch.tensor([48, 29]))


def test_positions():
    qkv, descales = fp8_inputs(torch.float8_e4m3fn, per_head=False, Nq=24, Nk=40)
    check(causal_softmax, qkv, descales, torch.float32, q_offset=16, seq_len=50)


def test_rope_runs_on_fp8():
    """rope declares runs_on_fp8 (a rotation commutes with a positive per-head factor). The rotated halves go to
    UPCAST_DTYPE for q·kᵀ: each score moves by at most ε = 2 u_p ‖q_i‖‖k_j‖ · scale (both rounded, a rotation
    keeps norms), so the weights by a factor within e^(±2ε) and out by at most (e^(2ε) - 1) Σ_j w_j |v_j|, on
    top of the P·V bound of the module's doc."""
    from attnfuse.examples import llama

    (q, k, v), descales = fp8_inputs(torch.float8_e4m3fn, per_head=False)
    out = llama(q, k, v, **descales, out_dtype=torch.float32)
    ref = llama.reference(q, k, v, **descales)
    naive = llama.reference(q, k, v, **descales, dtype=torch.float32)
    norms = [(t.double() * descales[f"{n}_descale"].double()).norm(dim=-1).max() for n, t in (("q", q), ("k", k))]
    u_p = P_ROUNDOFF["cpu"]
    eps = 2 * u_p * norms[0] * norms[1] / math.sqrt(D)
    w_abs_v = llama.reference(q, k, v.float().abs().to(v.dtype), **descales)
    bound = (math.expm1(2 * eps) + u_p) * w_abs_v
    assert_matches_reference(out, ref, naive, dtype=torch.float32, rounding=bound)


def test_transforms_refuse_fp8_unless_they_declare_it():
    normed = af.attention(lambda q, k, v: af.softmax(af.causal(af.scaled_dot_product(*af.qk_norm(q, k)))) @ v)
    qkv, descales = fp8_inputs(torch.float8_e4m3fn, per_head=False)
    with pytest.raises(af.UnsupportedError, match=r"qk_norm reads q or k values .* runs_on_fp8=True"):
        normed(*qkv, **descales)


def test_runs_on_fp8_must_be_a_bool():
    with pytest.raises(DeclarationError, match="runs_on_fp8 must be True or False"):
        attrs.evolve(af.combinators()["rope"].combinator, runs_on_fp8="yes")


# ---- refusals: bad input (InputError naming the argument) ----


@pytest.mark.parametrize("missing", ["q_descale", "k_descale", "v_descale"])
def test_missing_descale(missing):
    qkv, descales = fp8_inputs(torch.float8_e4m3fn, per_head=False)
    del descales[missing]
    with pytest.raises(af.InputError, match=f"need {missing}"):
        causal_softmax(*qkv, **descales)


@pytest.mark.parametrize(
    "bad",
    [
        torch.ones(2, 2, dtype=torch.float64),  # dtype
        torch.ones(2, 2, dtype=torch.float16),
        torch.ones(2),  # shape
        torch.ones(2, 4),  # (B, Hq), not (B, Hkv)
        torch.ones(1, 1, 1),
        1.0,  # not a tensor
        torch.ones(2, 2, device="meta"),  # device
    ],
    ids=["float64", "float16", "shape-2", "per-q-head", "rank-3", "number", "device"],
)
@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_bad_descale(name, bad):
    qkv, descales = fp8_inputs(torch.float8_e4m3fn, per_head=True)
    descales[name] = bad
    with pytest.raises(af.InputError, match=name):
        causal_softmax(*qkv, **descales)


@pytest.mark.parametrize("given", ["q_descale", "k_descale", "v_descale", "out_dtype"])
def test_fp8_arguments_refused_for_other_dtypes(given):
    q, k, v = (torch.randn(B, H, 16, D) for H in (HQ, HKV, HKV))
    value = torch.float32 if given == "out_dtype" else torch.ones(1)
    with pytest.raises(af.InputError, match=f"{given} apply to float8"):
        causal_softmax(q, k, v, **{given: value})
    with pytest.raises(af.InputError, match="apply to float8"):
        causal_softmax.reference(q, k, v, q_descale=torch.ones(1))


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float8_e4m3fn, torch.float16, torch.float16),
        (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16),
        (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fn),  # float8 kinds do not mix (FA3's rule)
        (torch.float16, torch.float8_e5m2, torch.float8_e5m2),
    ],
)
def test_mixed_dtypes(dtypes):
    (q, k, v), descales = fp8_inputs(torch.float8_e4m3fn, per_head=False)
    q, k, v = (t.float().to(dtype) for t, dtype in zip((q, k, v), dtypes))
    with pytest.raises(af.InputError, match="must share one dtype"):
        causal_softmax(q, k, v, **descales)


@pytest.mark.parametrize("out_dtype", [torch.float64, torch.float8_e4m3fn, torch.int32, "bfloat16"])
def test_bad_out_dtype(out_dtype):
    qkv, descales = fp8_inputs(torch.float8_e4m3fn, per_head=False)
    with pytest.raises(af.InputError, match="out_dtype must be torch.bfloat16, torch.float16 or torch.float32"):
        causal_softmax(*qkv, **descales, out_dtype=out_dtype)


# ---- refusals: what float8 does not run (UnsupportedError naming it) ----


def test_no_backward():
    qkv, descales = fp8_inputs(torch.float8_e4m3fn, per_head=False)
    bias = torch.randn(1, 1, 40, 40, requires_grad=True)
    with pytest.raises(af.UnsupportedError, match="float8 calls have no backward"):
        biased(*qkv, bias, **descales)


def test_no_split_kv():
    (q, k, v), descales = fp8_inputs(torch.float8_e4m3fn, per_head=False, Nq=2)
    with pytest.raises(af.UnsupportedError, match=r"split-KV decoding path \(split_kv=True\)"):
        af.run_attention(causal_softmax.graph(), q, k, v, split_kv=True, **descales)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_paged_cache(per_head, kv_layout):
    """A float8 paged cache (a decoding step and a prefill chunk, pages shared and out of order, a sequence
    shorter than its pages): each sequence's keys take its (batch, kv head)'s descale."""
    for Nq in (2, 24):
        (q, k, v), descales = fp8_inputs(torch.float8_e4m3fn, per_head, Nq=Nq, Nk=32)
        pages = [t.float().permute(0, 2, 1, 3).reshape(B * 2, 16, HKV, D) for t in (k, v)]  # (pages, 16, Hkv, D)
        if kv_layout == "HND":
            pages = [t.transpose(1, 2).contiguous() for t in pages]
        pool_k, pool_v = (t.to(k.dtype) for t in pages)
        table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
        lens = torch.tensor([32, 20])
        call = dict(block_table=table, kv_lens=lens, kv_layout=kv_layout)
        check(causal_softmax, (q, pool_k, pool_v), descales, torch.float32, **call)


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_packed_sequences(per_head):
    """Packed documents (lengths 0 and 1 among them, GQA): each document's rows of out and lse against the
    float64 reference of that document alone."""
    lengths = [13, 0, 1, 26]
    total = sum(lengths)
    (q, k, v), descales = fp8_inputs(torch.float8_e4m3fn, per_head, Nq=total, Nk=total)
    q, k, v = q[:1], k[:1], v[:1]
    descales = {name: d[:1] for name, d in descales.items()}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = causal_softmax(
        q, k, v, **descales, out_dtype=torch.float32, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True
    )
    for start, n in zip(cu[:-1].tolist(), lengths):
        if n:
            rows = slice(start, start + n)
            alone = [t[:, :, rows] for t in (q, k, v)]
            assert_within_bounds(causal_softmax, alone, descales, out[:, :, rows], lse[:, :, rows])


def test_no_descales_past_the_program_call():
    """The paths that take no descales (torch.compile's op, context parallelism) refuse float8 inputs."""
    (q, k, v), _ = fp8_inputs(torch.float8_e4m3fn, per_head=False)
    with pytest.raises(af.InputError, match="float8 q, k, v need q_descale, k_descale and v_descale"):
        planned(causal_softmax.graph(), q, k, v, {}, None, None, return_lse=False, grads=None, split_kv=None)


@pytest.mark.parametrize(
    "dtype,head_dim,reason",
    [
        ("float8_e4m3fn", 128, None),
        ("float8_e4m3fn", 64, None),
        ("float8_e4m3fn", 256, "the forward template takes float8 at head dims 64, 128, not 256"),
        ("float8_e5m2", 128, None),
        ("float8_e5m2", 64, None),
        ("float8_e5m2", 256, "the forward template takes float8 at head dims 64, 128, not 256"),
    ],
)
def test_the_hopper_forward_template_takes_both_float8_types_and_says_why_not_the_rest(dtype, head_dim, reason):
    """Its P·V rounds P to e4m3 in both (kernels/forward_fp8.py): with e5m2 values, wgmma multiplies e4m3 by
    e5m2."""
    config = KernelConfig(
        arch="sm90", dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, group=1, save_lse=False,
        fp32_precision="ieee",
    )  # fmt: skip
    assert forward_reason(lowered(causal_softmax.graph(), config)) == reason


@pytest.mark.parametrize("fact", ["kv_lens", "positions", "varlen"])
def test_the_hopper_forward_template_takes_float8_with_each_fact(fact):
    """kv_lens, given positions and packed sequences (V's copy by document: ``document_values``)."""
    config = KernelConfig(
        arch="sm90", dtype="float8_e4m3fn", head_dim=128, head_dim_v=128, group=1, save_lse=False,
        fp32_precision="ieee", **{fact: True},
    )  # fmt: skip
    assert forward_reason(lowered(causal_softmax.graph(), config)) is None


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_a_packed_forward_instance_reads_and_writes_each_document_at_its_rows(dtype):
    """Every row of q, k, v, out and lse that a packed call's forward instance addresses by pointer is offset by its
    document's first row (q_start, k_start; a float8 instance's V copy by v_start): a float8 instance that stored
    out at the pack's first rows passed every CPU check and failed on an H100."""
    from attnfuse.kernels.verify import variant_plan

    source = variant_plan("causal", dtype, 128, "varlen").templates.kernels["forward"].source
    pointer_rows = re.findall(r"row_offsets\(\w+, b, h, gl\.expand_dims\(([^,]+), 1\)", source)
    assert pointer_rows and all(r.startswith("q_start + ") for r in pointer_rows), pointer_rows
    start = {"Q": "q_start + ", "K": "k_start + ", "V": "k_start + " if dtype == "bfloat16" else "v_start + "}
    loads = re.findall(r"load_(?:rows|rows_t|value_rows)\((\w+), \w+, b, h\w*, ([^,]+), ([^,]+),", source)
    assert {tensor for tensor, _, _ in loads} == {"Q", "K", "V"}, loads
    for tensor, first, count in loads:
        assert first.startswith(start[tensor]) and count.startswith(start[tensor]), (tensor, first, count)
    assert "Lse + pid_bh.to(tl.int64) * TOTAL_Q + q_start + lse_idx" in source


def test_a_device_no_gpu_run_has_checked_refuses_fp8_unless_asked(monkeypatch):
    """A device whose architecture no run has checked the float8 kernel on refuses it, naming the opt-in."""
    qkv, descales = fp8_inputs(torch.float8_e4m3fn, per_head=False)
    monkeypatch.setattr(fp8_module, "GATE", attrs.evolve(fp8_module.GATE, checked=()))  # unchecked
    monkeypatch.delenv(fp8_module.GATE.env, raising=False)
    with pytest.raises(af.UnsupportedError, match="no run has checked the kernels there.*ATTNFUSE_FP8_ON_GPU=1"):
        causal_softmax(*qkv, **descales)
    monkeypatch.setenv(fp8_module.GATE.env, "1")
    check(causal_softmax, qkv, descales, torch.float32)


ACCUMULATOR_ROUNDOFF = 2.0**-13
"""Assumed: within the 32 terms a float8 q·kᵀ sums before float32 takes over (``max_num_imprecise_acc``),
Hopper's tensor cores keep at least 13 significant bits (DeepSeek-V3 measured about 14), so each score is off
by at most 2⁻¹³ Σ_i |q_i k_i| · scale beyond float32 (softcap, alibi, a bias and masks do not enlarge it)."""


@requires_cuda
@pytest.mark.parametrize("dtype", FP8, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("name", PROGRAMS)
def test_on_a_gpu(monkeypatch, name, dtype, per_head):
    """The generated float8 forward on a GPU (sm89+: float8 q·kᵀ, bfloat16 P·V), production head dim, against the
    float64 reference at the module doc's GPU bounds. It asks for float8 calls (ATTNFUSE_FP8_ON_GPU=1), so it checks
    any architecture; a GPU runs them by default only on the architectures where it has passed (runtime/fp8.py:
    GATE). The templates are off: on sm90 an e4m3 call the forward template takes runs its float8 instance, which
    rounds P to e4m3 and is checked at its own bounds (tests/test_template_gpu.py, kernels/verify_fp8.py)."""
    monkeypatch.setenv(fp8_module.GATE.env, "1")
    monkeypatch.setenv(verified.MODE_ENV, "off")
    program, extra = PROGRAMS[name]
    (q, k, v), descales = fp8_inputs(dtype, per_head, Nq=300, Nk=300, device="cuda", head_dim=128)
    q64, k64 = (fp8_module.dequantised(t, descales[f"{n}_descale"], torch.float64) for n, t in (("q", q), ("k", k)))
    magnitude = (q64.abs() @ k64.abs().repeat_interleave(HQ // HKV, 1).transpose(-1, -2)).max().item()
    score_error = ACCUMULATOR_ROUNDOFF * magnitude * (0.5 if name == "softcap" else 128**-0.5)
    check(program, (q, k, v), descales, None, [t.cuda() for t in extra(300)], score_error=score_error)


@pytest.mark.parametrize(
    "device,templates",
    [("cpu", "off"), *(pytest.param("cuda", mode, marks=requires_cuda) for mode in ("off", "all"))],
)
@pytest.mark.parametrize("dtype", FP8, ids=lambda d: str(d)[6:])
def test_nan_values_and_keys_reach_out_where_the_reference_has_them(monkeypatch, device, templates, dtype):
    """A NaN value makes out NaN in its column of every row that keeps its key, and a NaN key the whole row, as in
    the reference, in both float8 types: on a GPU in the generated kernel and (sm90, ``templates`` "all") in the
    forward template's instance. Triton 3.6 turns e5m2 into bfloat16 by moving its bits, which made NaN and Inf
    finite (both kernels upcast by float16 since)."""
    monkeypatch.setenv(fp8_module.GATE.env, "1")
    monkeypatch.setenv(verified.MODE_ENV, templates)
    (q, k, v), descales = fp8_inputs(dtype, per_head=True, Nq=150, Nk=150, device=device, head_dim=64)
    k[:, :, 100, 5] = float("nan")  # rows from 100 on keep key 100: NaN rows
    v[:, :, 60, ::7] = float("nan")  # rows from 60 on keep key 60: NaN in its columns
    out = causal_softmax(q, k, v, **descales)
    ref = causal_softmax.reference(q, k, v, **descales)
    assert ref.isnan().any() and torch.equal(out.isnan(), ref.isnan()), (
        f"out is NaN in {int(out.isnan().sum())} elements, the reference in {int(ref.isnan().sum())}"
    )
    assert not out.isinf().any()


def test_under_torch_compile_an_fp8_call_runs_eagerly():
    """Dynamo leaves a call with descales out of the graph (a graph break) and runs it eagerly."""
    qkv, descales = fp8_inputs(torch.float8_e5m2, per_head=True)
    step = torch.compile(
        lambda q, k, v: causal_softmax(q, k, v, **descales, out_dtype=torch.float32) * 2, backend="eager"
    )
    assert torch.equal(step(*qkv), causal_softmax(*qkv, **descales, out_dtype=torch.float32) * 2)


TAKING_RESERVED_NAMES = {
    "q_descale": lambda q, k, v, q_descale: None,
    "k_descale": lambda q, k, v, k_descale: None,
    "v_descale": lambda q, k, v, v_descale: None,
    "out_dtype": lambda q, k, v, out_dtype: None,
}


@pytest.mark.parametrize("name", TAKING_RESERVED_NAMES)
def test_fp8_argument_names_are_reserved(name):
    with pytest.raises(af.ProgramError, match=rf"argument name\(s\) \['{name}'\] are reserved"):
        af.attention(TAKING_RESERVED_NAMES[name])


def test_show_prints_the_fp8_kernel_and_its_engines(capsys):
    from attnfuse.cli import main

    assert main(["show", "gpt2", "--arch", "sm90", "--dtype", "float8_e4m3fn", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "forward: template (verified)" in out  # its float8 instance passed the GPU check (kernels/verify_fp8.py)
    assert "decode: generated — a float8 call never takes the split-KV path" in out
    assert "dkdv: generated — float8 calls have no backward" in out and "dq: generated — float8 calls have" in out
    assert "s = s * qk_descale" in out and "acc = tl.dot(p.to(UPCAST_DTYPE), v, acc)" in out


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_show_reports_the_fp8_forwards_resources_and_never_a_hoisted_transform(capsys, tmp_path, monkeypatch, dtype):
    """`show --resources` of a float8 call with RoPE: the forward kernel (the one the call runs, RoPE inside it:
    a float8 call never hoists) compiles for sm90 with float8 q, k, v, and ptxas' figures are those of
    ``generated_resources`` for it; the backward kinds, which never run, have none."""
    from attnfuse.cli import main
    from attnfuse.examples import EXAMPLES
    from attnfuse.kernels.generated_resources import generated_resources
    from attnfuse.kernels.tiles import SHARED_MEMORY_LIMIT
    from attnfuse.runtime.compiled import compiled
    from attnfuse.runtime.source_cache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernels"))
    code = main(["show", "llama", "--json", "--resources", "--arch", "sm90", "--dtype", dtype, "--head-dim", "64"])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "", captured.err
    report = json.loads(captured.out)
    assert report["transforms"]["hoisted_from_queries"] is None
    kernels = report["kernels"]
    config = KernelConfig(arch="sm90", dtype=dtype, head_dim=64, head_dim_v=64, group=1, save_lse=False,
                          fp32_precision="ieee")  # fmt: skip
    plan = compiled(EXAMPLES["llama"].graph(), config).plan
    used = generated_resources(plan, "forward", shared_limit=SHARED_MEMORY_LIMIT)
    forward = kernels["forward"]
    assert forward["hoisted"] is False and forward["name"] == plan.kernels["forward"].name
    assert (forward["registers"], forward["spill_bytes"], forward["shared_bytes"]) == (
        used.registers, used.spill_bytes, used.shared_bytes,
    )  # fmt: skip
    assert "registers" not in kernels["dkdv"] and "registers" not in kernels["dq"]


# bytes the float8 forward spills today with the table's tiles (ptxas for sm90), per (example, head dim)
KNOWN_FP8_SPILLS = {("alibi", 128): 8}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("example", ["llama", "gpt2", "mistral", "alibi", "relu"])
def test_the_fp8_forward_keeps_its_registers_on_sm90(tmp_path, monkeypatch, example, head_dim):
    """The float8 forward compiled for sm90 with the table's float8 tiles spills nothing (bfloat16's 128 x 128
    spilled 2804 bytes at D 128 and ran 1.8x slower on an H100), except where ``KNOWN_FP8_SPILLS`` says."""
    from attnfuse.examples import EXAMPLES
    from attnfuse.kernels.generated_resources import generated_resources
    from attnfuse.kernels.tiles import SHARED_MEMORY_LIMIT
    from attnfuse.runtime.compiled import compiled
    from attnfuse.runtime.source_cache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernels"))
    config = KernelConfig(arch="sm90", dtype="float8_e4m3fn", head_dim=head_dim, head_dim_v=head_dim, group=1,
                          save_lse=False, fp32_precision="ieee")  # fmt: skip
    plan = compiled(EXAMPLES[example].graph(), config).plan
    used = generated_resources(plan, "forward", shared_limit=SHARED_MEMORY_LIMIT)
    assert used.spill_bytes == KNOWN_FP8_SPILLS.get((example, head_dim), 0), f"{example} D{head_dim}: {used}"


def stored_key(n: torch.Tensor) -> torch.Tensor:
    """The column of the float8 instance's copy of Vᵀ that holds key n, from the layouts' description
    (kernels/fp8_pipeline.py): within each 32 keys, key 16·a1 + 8·a0 + 2·c + e is stored at 16·a1 + 4·c + 2·a0 + e."""
    a1, a0, c, e = n // 16, n // 8 % 2, n // 2 % 4, n % 2
    return 16 * a1 + 4 * c + 2 * a0 + e


@pytest.mark.parametrize("shape", [(2, 3, 37, 64), (1, 2, 130, 128), (1, 1, 1, 16)])
def test_the_float8_instance_reads_v_transposed_with_its_keys_permuted(shape):
    """The float8 forward instance's copy of V (kernels/launch_fp8.py), from a V in HF's (B, N, H, D) order:
    (B, Hkv, DV, Nk rounded up to 32), key n's values in column stored_key(n), the columns of no key zero."""
    from attnfuse.kernels.launch_fp8 import transposed_values

    B, H, N, DV = shape
    v = torch.randn(B, N, H, DV).to(torch.float8_e4m3fn).transpose(1, 2)
    got = transposed_values(v)
    padded = -(-N // 32) * 32
    assert got.shape == (B, H, DV, padded) and got.stride(3) == 1 and got.stride(2) % 16 == 0
    expected = torch.zeros(B, H, DV, padded, dtype=torch.uint8)
    expected[..., stored_key(torch.arange(N))] = v.transpose(2, 3).view(torch.uint8)
    assert torch.equal(got.view(torch.uint8), expected)
    assert sorted(stored_key(torch.arange(padded)).tolist()) == list(range(padded))  # a permutation


@pytest.mark.parametrize(
    "lengths, total",
    [((5, 0, 1, 37, 64, 3), 110), ((130,), 130), ((7, 70), 90), ((0, 0), 4)],
    ids=["ragged", "one", "rows-past-the-documents", "empty"],
)
def test_a_packed_float8_instance_reads_each_document_from_an_aligned_column(lengths, total):
    """A packed call's copy of V (kernels/launch_fp8_packed.py: document_values), from documents of ``lengths`` keys in
    ``total`` packed rows: (1, Hkv, DV, total + 32 (docs + 1) rounded up to 32); document i's key n in column
    first_i + stored_key(n), first_i = (its first row + 32 i) rounded down to 32 (the instance's v_start), the
    documents' columns apart, every other column zero (the rows past the last document's too)."""
    from attnfuse.kernels.launch_fp8_packed import document_values

    H, DV = 2, 16
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    v = torch.randn(1, total, H, DV).to(torch.float8_e5m2).transpose(1, 2)
    got = document_values(v, cu, len(lengths))
    width = -(-(total + 32 * (len(lengths) + 1)) // 32) * 32
    assert got.shape == (1, H, DV, width) and got.stride(3) == 1 and got.stride(2) % 16 == 0
    expected = torch.zeros(1, H, DV, width, dtype=torch.uint8)
    written = []
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        columns = (start + 32 * i) // 32 * 32 + stored_key(torch.arange(end - start))
        expected[..., columns] = v[:, :, start:end].transpose(2, 3).view(torch.uint8)
        written += columns.tolist()
    assert len(set(written)) == len(written) and max(written, default=0) < width
    assert torch.equal(got.view(torch.uint8), expected)


@requires_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_float8_call_takes_the_template_with_any_out_dtype(monkeypatch, out_dtype):
    """On sm90 an e4m3 causal call at head dim 128 runs the forward template's verified float8 instance whatever
    its out_dtype (verify.fp8_cases checked each on a GPU), and its out matches the generated kernel's to
    within their P's roundings (e4m3 with P·256 rounded: 2⁻⁴ relative, 2⁻¹⁸ absolute below e4m3's normal range;
    bfloat16: 2⁻⁸) and two roundings of out: each row's weights sum to one, so out moves by at most that much
    of max |v|."""
    from attnfuse.kernels.launch import TemplateForward

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the float8 template runs on sm90")
    (q, k, v), descales = fp8_inputs(torch.float8_e4m3fn, True, Nq=300, Nk=300, device="cuda", head_dim=128)
    before = TemplateForward.launches
    out = causal_softmax(q, k, v, **descales, out_dtype=out_dtype)
    assert TemplateForward.launches == before + 1 and out.dtype == out_dtype
    monkeypatch.setenv(verified.MODE_ENV, "off")  # read when a call is first planned
    clear_cache()
    expected = causal_softmax(q, k, v, **descales, out_dtype=out_dtype)
    assert TemplateForward.launches == before + 1
    v_max = fp8_module.dequantised(v, descales["v_descale"], torch.float64).abs().max().item()
    bound = (2**-4 + 300 * 2**-18 + 2**-8 + 2 * torch.finfo(out_dtype).eps) * v_max
    difference = (out.double() - expected.double()).abs().max().item()
    assert difference <= bound, f"out_dtype {out_dtype}: the template and the generated kernel differ by {difference}"
