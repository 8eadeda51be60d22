"""The GPU check of a float8 forward instance (``forward_fp8.py``; q, k, v in e4m3 or e5m2) against the float64
reference of the dequantised inputs, at a tolerance derived from what the instance rounds (the same for both
types: P rounds to e4m3 in both):

- q·kᵀ: products of two float8 values are exact; ``wgmma`` sums them in an accumulator assumed to keep at least
  13 significant bits (``ACCUMULATOR_BITS``; DeepSeek-V3 measured about 14) through each instruction of 32 terms,
  so a score is off by at most D / 32 · 2⁻¹³ · Σ_i |q_i k_i| · scale beyond float32 (``score_error``), which
  moves each weight by a factor within e^(±2 score_error) and lse by at most score_error.
- P·V: P · P_SCALE rounds to e4m3 (relative 2⁻⁴ down to e4m3's normal range, 2⁻⁶, absolute 2⁻¹⁰ below it, so
  2⁻¹⁸ in P), and the products sum in the narrow accumulator, one rounding of 2⁻¹³ relative per 32 keys. With
  weights of at most 1 that sum to at least 1 (a softmax's: the variants checked save lse), out is off by at most
  (2⁻⁴ + (e^(2 score_error) − 1) + ⌈Nk / 32⌉ · 2⁻¹³) · (the reference's out for |v|) + 2⁻¹⁸ · Σ_j |v_j|.
- out rounds to its dtype (``OUT_ROUNDOFF``: bfloat16 2⁻⁸, float16 2⁻¹¹, float32 none): u · (|ref| + that bound).

A case with a NaN value (``poison``) must make out NaN exactly where the reference is (the rows that keep that
key, in its NaN columns: the careful redo sorts the rows out) and meet the bounds elsewhere.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..runtime.fp8 import dequantised
from ..testing.tolerances import assert_matches_reference
from .launch import TemplateForward

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # the cases' dtypes
ACCUMULATOR_BITS = 13
TERMS_PER_INSTRUCTION = 32  # a float8 wgmma's K
P_ROUNDOFF = 2.0**-4  # e4m3's unit roundoff
P_ABSOLUTE = 2.0**-10 / 256  # below e4m3's normal range, in P (fp8_pipeline.P_SCALE = 256)
OUT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}  # by out_dtype


def quantised(
    x: torch.Tensor, kv_heads: int, gen: torch.Generator, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, N, D) float32 scaled into float8 ``dtype``'s range and rounded to it, with its (B, kv_heads) descale
    (a kv group's query heads sharing one), times a random factor in [1, 2) so that no descale is the plain amax /
    max."""
    B, H = x.shape[:2]
    amax = x.abs().amax(dim=(2, 3)).view(B, kv_heads, H // kv_heads).amax(-1)
    descale = (amax / torch.finfo(dtype).max * (1 + torch.rand(amax.shape, device=x.device, generator=gen))).float()
    scale = descale.repeat_interleave(H // kv_heads, dim=1)[:, :, None, None]
    return (x / scale).to(dtype), descale


def check_fp8(
    program: Callable,
    kwargs: dict,
    shape: tuple,
    head_dim: int,
    seed: int,
    case_id: str,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    poison: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    facts: dict | None = None,
) -> dict:
    """Run ``program`` on fresh float8 q, k, v (``dtype``) of ``shape`` (B, Hq, Hkv, Nq, Nk) through its forward
    instance, with ``out_dtype`` and the call's ``facts`` (kv_lens or positions: ``verify.fact_arguments``;
    ``poison``, if given, writes NaN values into k and v: ``verify.poisoned``), and compare out and lse with the float64
    reference at the module's bounds (AssertionError beyond them, if out is NaN elsewhere than the reference, if
    out is not of ``out_dtype``, or if the template did not run); its result."""

    B, Hq, Hkv, Nq, Nk = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    raw = [torch.randn(B, h, n, head_dim, device="cuda", generator=gen) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk))]
    (q, qd), (k, kd), (v, vd) = (quantised(t, Hkv, gen, dtype) for t in raw)
    if poison is not None:
        poison(k, v)
    call = {"q_descale": qd, "k_descale": kd, "v_descale": vd, **(facts or {})}  # the descales and facts
    before = TemplateForward.launches
    out, lse = program(q, k, v, return_lse=True, out_dtype=out_dtype, **kwargs, **call)
    if TemplateForward.launches == before:
        raise AssertionError(f"{case_id}: the call did not run the forward template")
    if out.dtype != out_dtype:
        raise AssertionError(f"{case_id}: out is {out.dtype}, the call asked for {out_dtype}")
    ref, ref_lse = program.reference(q, k, v, return_lse=True, **kwargs, **call)
    naive, naive_lse = program.reference(q, k, v, return_lse=True, dtype=torch.float32, **kwargs, **call)
    q64, k64, v64 = (dequantised(t, d, torch.float64) for t, d in ((q, qd), (k, kd), (v, vd)))
    group = Hq // Hkv
    keys = k64.abs().nan_to_num(0.0).repeat_interleave(group, 1)  # a NaN key is past its sequence's length
    magnitude = (q64.abs() @ keys.transpose(-1, -2)).amax(-1)  # (B, Hq, Nq)
    score_error = head_dim / TERMS_PER_INSTRUCTION * 2.0**-ACCUMULATOR_BITS * magnitude * head_dim**-0.5
    assert_matches_reference(lse, ref_lse, naive_lse, torch.float32, what="lse", rounding=score_error)
    nan = ref.isnan()
    if not torch.equal(out.isnan(), nan):
        raise AssertionError(
            f"{case_id}: out is NaN in {int(out.isnan().sum())} elements, the reference in {int(nan.sum())}"
        )
    v_abs = v.float().abs().to(v.dtype)  # exact
    weights = P_ROUNDOFF + torch.expm1(2 * score_error) + math.ceil(Nk / TERMS_PER_INSTRUCTION) * 2.0**-13
    pv = weights[..., None] * program.reference(q, k, v_abs, **kwargs, **call)
    # a NaN value adds nothing where out is finite: the rows that keep it are NaN in its columns
    pv = pv + P_ABSOLUTE * v64.abs().nan_to_num(0.0).sum(2, keepdim=True).repeat_interleave(group, 1)
    u_out = OUT_ROUNDOFF[out_dtype]
    bound = (pv + u_out * (ref.abs() + pv)).masked_fill(nan, 0.0)
    finite = [t.masked_fill(t.isnan() | nan, 0.0) for t in (out, ref, naive)]
    assert_matches_reference(*finite, torch.float32, rounding=bound)
    error = (finite[0].double() - finite[1]).abs().max().item()
    return {"key": TemplateForward.last_key, "case": case_id, "max_error": error}
