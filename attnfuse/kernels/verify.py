"""The GPU check of the template instances against the float64 reference, and the record it writes.

``tests/test_template_gpu.py`` runs ``check`` on every case of ``cases()`` (the forward template: each built-in
and installed contrib variant, head dims 64/128/256, float16 and bfloat16, GQA, lengths that are not multiples
of a tile, Nq != Nk, non-finite values under the masks; ``DROPOUT_VARIANTS`` with attention dropout too) and
of ``backward_cases()`` (the dK/dV template: its gradients dq, dk, dv through the public API) with
``ATTNFUSE_TEMPLATES=all`` (and ``ATTNFUSE_DROPOUT_ON_GPU=1``), and appends each result to a file in
``$ATTNFUSE_VERIFY_OUT``. A dropout case compares with the float64 reference replaying the call's mask
(``af.dropout_keep``). Then

    python -m attnfuse.kernels.verify --collect $ATTNFUSE_VERIFY_OUT --write attnfuse/kernels/verified.json

writes the record (``verified.py``): every instance each of whose cases ran and passed, and no other.
``python -m attnfuse.kernels.verify --keys`` prints, with no GPU, the instance each variant's cases run and
whether the record holds it: what a change to the templates or to a fragment un-verified.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
from pathlib import Path
from typing import Callable

import torch
from attrs import frozen

import attnfuse as af
from ..testing.grad_bounds import delta_rounding
from ..runtime.dropout import GATE as DROPOUT_GATE
from ..testing.tolerances import assert_matches_reference
from .launch import TemplateDkdv, TemplateForward
from .verified import MODE_ENV, RECORD, is_verified, record_key

OUT_ENV = "ATTNFUSE_VERIFY_OUT"
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
SHAPES = ((2, 4, 2, 300, 300), (1, 2, 2, 130, 257))  # (B, Hq, Hkv, Nq, Nk): GQA; ragged, fewer queries
HOISTED_SHAPES = ((1, 4, 2, 600, 600), (1, 2, 2, 520, 700))  # enough query blocks that a qk transform is hoisted
DKDV_HEAD_DIMS = (64, 128)  # the dK/dV template's (``tiles.DKDV_TILES``)
DROPOUT_VARIANTS = ("causal", "softcap")  # checked with attention dropout too (smooth weights: their dK/dV as well)
DROPOUT_P = 0.2  # their dropout rate


def _variants() -> dict[str, tuple[Callable, Callable]]:
    """name -> (program, its runtime arguments beyond q, k, v for (Hq, Nq, Nk, device))."""
    none = lambda *_: {}  # noqa: E731
    found = {
        "dense": (af.attention(lambda q, k, v: af.softmax(af.scaled_dot_product(q, k)) @ v), none),
        "causal": (af.attention(lambda q, k, v: af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v), none),
        "sliding_window": (
            af.attention(lambda q, k, v: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left=100)) @ v),
            none,
        ),
        "causal_alibi": (
            af.attention(lambda q, k, v: af.softmax(af.alibi(af.causal(af.scaled_dot_product(q, k)))) @ v),
            none,
        ),
        "rope_causal": (af.attention(lambda q, k, v: af.softmax(af.causal(af.rope(q, k))) @ v), none),
        "relu": (af.attention(lambda q, k, v: af.relu_attention(af.causal(af.scaled_dot_product(q, k))) @ v), none),
        "softcap": (
            af.attention(lambda q, k, v: af.softmax(af.softcap(af.causal(af.scaled_dot_product(q, k)), cap=20.0)) @ v),
            none,
        ),
        "sinks": (
            af.attention(
                lambda q, k, v, sinks: af.softmax_with_sinks(af.causal(af.scaled_dot_product(q, k)), sinks) @ v
            ),
            lambda hq, nq, nk, device: {"sinks": torch.randn(hq, device=device)},
        ),
        "additive_bias": (
            af.attention(lambda q, k, v, bias: af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v),
            lambda hq, nq, nk, device: {"bias": torch.randn(1, hq, nq, nk, device=device)},
        ),
    }
    if "sigmoid_attention" in af.combinators():  # the contrib package, where installed
        found["sigmoid"] = (
            af.attention(lambda q, k, v: af.sigmoid_attention(af.causal(af.scaled_dot_product(q, k))) @ v),
            none,
        )
    return found


VARIANTS = _variants()


@frozen
class Case:
    variant: str
    head_dim: int
    dtype: str
    shape: tuple[int, int, int, int, int]
    poison: bool  # a NaN value that some rows mask and the others keep: the careful redo must sort them out
    kind: str = "forward"  # the template checked: "forward" (out, lse) or "dkdv" (the gradients)
    dropout: float = 0.0  # the call's dropout_p: its instance is the program's instance with dropout

    @property
    def id(self) -> str:
        B, Hq, Hkv, Nq, Nk = self.shape
        kind = "" if self.kind == "forward" else f"{self.kind}-"
        shape = f"{B}x{Hq}x{Hkv}x{Nq}x{Nk}"
        dropout = f"-dropout{self.dropout}" if self.dropout else ""
        return f"{kind}{self.variant}-D{self.head_dim}-{self.dtype}-{shape}{'-nan' if self.poison else ''}{dropout}"


def _shapes(variant: str) -> tuple:
    return HOISTED_SHAPES if variant.startswith("rope") else SHAPES


def cases() -> list[Case]:
    """The forward template's cases."""
    found = [Case(v, d, t, s, False) for v in VARIANTS for d in HEAD_DIMS for t in DTYPES for s in _shapes(v)]
    masked = ("causal", "sliding_window", "causal_alibi", "relu", "sigmoid")
    found += [Case(v, d, "bfloat16", SHAPES[0], True) for v in masked if v in VARIANTS for d in HEAD_DIMS]
    return found + _dropout_cases("forward")


def _dropout_cases(kind: str) -> list[Case]:
    """``kind``'s cases with attention dropout: ``DROPOUT_VARIANTS`` at the dK/dV template's head dims, both
    dtypes, the forward's shapes (GQA, ragged)."""
    return [
        Case(v, d, t, s, False, kind=kind, dropout=DROPOUT_P)
        for v in DROPOUT_VARIANTS
        for d in DKDV_HEAD_DIMS
        for t in DTYPES
        for s in _shapes(v)
    ]


def smooth(variant: str) -> bool:
    """Whether the variant's normaliser has smooth weights: a non-smooth one's (relu) float16 and bfloat16
    gradients are not compared with the reference (``NormaliserFragment.smooth``), so it has no dK/dV case."""
    program, extra = VARIANTS[variant]
    return program.graph(**extra(1, 1, 1, "cpu")).weights.apply.fragment().smooth


def backward_cases() -> list[Case]:
    """The dK/dV template's cases: each variant with smooth weights, its head dims, both dtypes, the forward's
    shapes, and ``DROPOUT_VARIANTS`` with attention dropout. None with NaN values: a masked key's NaN value
    makes the float64 reference's gradients NaN (its masked weights' dS is 0 · NaN), where the kernels' are 0."""
    return [
        Case(v, d, t, s, False, kind="dkdv")
        for v in VARIANTS
        if smooth(v)
        for d in DKDV_HEAD_DIMS
        for t in DTYPES
        for s in _shapes(v)
    ] + _dropout_cases("dkdv")


def _environment(case: Case) -> None:
    """A RuntimeError unless the environment runs ``case``'s template instance on the GPU."""
    if os.environ.get(MODE_ENV) != "all":
        raise RuntimeError(f"the check runs the template instances: set {MODE_ENV}=all")
    if case.dropout and os.environ.get(DROPOUT_GATE.env) != "1":
        raise RuntimeError(f"the check runs the kernels with attention dropout: set {DROPOUT_GATE.env}=1")


@contextlib.contextmanager
def replayed_dropout(case: Case, seed: int, shape: tuple[int, int, int, int], device: torch.device):
    """Around a call of ``case`` (q (B, Hq, Nq, D) and Nk keys: ``shape`` (B, Hq, Nq, Nk)): yields the call's
    dropout arguments and a dict that, once the call returned, holds the reference's (``dropout_p`` and the
    mask the call drew, replayed: ``af.dropout_keep``); both empty without dropout."""
    call: dict = {"dropout_p": case.dropout} if case.dropout else {}
    reference: dict = {}
    if case.dropout:
        torch.manual_seed(seed)  # the call draws its dropout state from the default generator
    yield call, reference
    if case.dropout:
        torch.manual_seed(seed)
        reference.update(call, dropout_mask=af.dropout_keep(af.dropout_state(device), case.dropout, shape))


def check(case: Case, seed: int = 0) -> dict:
    """Run ``case`` through its template instance on the GPU and compare out and lse (or, for a dK/dV case,
    the gradients) with the float64 reference (AssertionError if they differ beyond what the dtype allows, or
    if the template did not run); its result."""
    if case.kind == "dkdv":
        return _check_dkdv(case, seed)
    program, extra = VARIANTS[case.variant]
    B, Hq, Hkv, Nq, Nk = case.shape
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, case.head_dim, device="cuda", dtype=dtype, generator=gen) for h, n in
               ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))  # fmt: skip
    if case.poison:  # rows before position 2 Nk / 3 (causal), or past it by more than a window, mask this key
        v[:, :, 2 * Nk // 3, ::3] = float("nan")
    kwargs = extra(Hq, Nq, Nk, "cuda")
    _environment(case)
    before = TemplateForward.launches
    with replayed_dropout(case, seed, (B, Hq, Nq, Nk), q.device) as (dropout, replayed):
        if program.graph(**kwargs).has_lse:
            out, lse = program(q, k, v, return_lse=True, **kwargs, **dropout)
        else:
            out, lse = program(q, k, v, **kwargs, **dropout), None
    if TemplateForward.launches == before:
        raise AssertionError(f"{case.id}: the call did not run the forward template")
    ref = program.reference(q, k, v, return_lse=lse is not None, **kwargs, **replayed)
    low = program.reference(q, k, v, return_lse=lse is not None, dtype=dtype, **kwargs, **replayed)
    if lse is not None:  # lse reads q and k only: as close as inputs of the call's dtype allow
        (ref, ref_lse), (low, low_lse) = ref, low
        assert_matches_reference(lse, ref_lse, low_lse, dtype, what="lse")
    nan = ref.isnan()  # a kept key's NaN value: NaN in exactly those elements, the rest compared
    if not torch.equal(out.isnan(), nan):
        raise AssertionError(
            f"{case.id}: out is NaN in {int(out.isnan().sum())} elements, the reference in {int(nan.sum())}"
        )
    assert_matches_reference(
        out.masked_fill(nan, 0), ref.masked_fill(nan, 0), low.masked_fill(low.isnan() | nan, 0), dtype
    )
    finite = torch.isfinite(ref)
    error = (out.double() - ref)[finite].abs().max().item() if finite.any() else 0.0
    return {"key": TemplateForward.last_key, "case": case.id, "max_error": error}


def _check_dkdv(case: Case, seed: int) -> dict:
    """Forward and backward through the public API (the dK/dV template's instance computes dk and dv, the
    generated dQ kernel dq); dq, dk and dv against the float64 reference's gradients, with the bound of
    delta's rounding (``grad_bounds``) for normalisers that read delta."""
    program, extra = VARIANTS[case.variant]
    B, Hq, Hkv, Nq, Nk = case.shape
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, case.head_dim, device="cuda", dtype=dtype, generator=gen) for h, n in
               ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))  # fmt: skip
    dout = torch.randn(B, Hq, Nq, case.head_dim, device="cuda", dtype=dtype, generator=gen)
    kwargs = extra(Hq, Nq, Nk, "cuda")
    _environment(case)
    before = TemplateDkdv.launches
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with replayed_dropout(case, seed, (B, Hq, Nq, Nk), q.device) as (dropout, replayed):
        got = torch.autograd.grad(program(*leaves, **kwargs, **dropout), leaves, dout)
    if TemplateDkdv.launches == before:
        raise AssertionError(f"{case.id}: the call did not run the dK/dV template")
    error = compare_gradients(program, kwargs, (q, k, v), dout, got, case.id, replayed)
    return {"key": TemplateDkdv.last_key, "case": case.id, "max_error": error}


def compare_gradients(
    program,
    kwargs: dict,
    qkv: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    got: tuple[torch.Tensor, ...],
    what: str,
    dropout: dict | None = None,
) -> float:
    """Compare ``got`` (dq, dk, dv of ``program`` at q, k, v = ``qkv`` for the output gradient ``dout``, all of
    one dtype) with the float64 reference's gradients (AssertionError beyond what the dtype allows, with the
    bound of delta's rounding, ``grad_bounds``, for a normaliser that reads delta); the largest error.
    ``dropout``: the call's ``dropout_p`` and replayed ``dropout_mask``, for the reference (None: none)."""
    dtype = dout.dtype
    graph = program.graph(**kwargs)
    kwargs = {**kwargs, **(dropout or {})}
    leaves64 = [t.detach().double().requires_grad_(True) for t in qkv]
    if graph.has_lse:
        out64, lse64 = program.reference(*leaves64, return_lse=True, **kwargs)
    else:
        out64, lse64 = program.reference(*leaves64, **kwargs), None
    rounding = [None] * 3
    if lse64 is not None and graph.weights.apply.fragment().needs_delta:
        q, k, v = (t.detach().double() for t in qkv)
        with torch.no_grad():
            weighted = program.reference(q, k, v.abs(), return_lse=True, **kwargs)[0]
        rounding = delta_rounding(lse64, out64, weighted, dout, leaves64, dtype)
    want64 = torch.autograd.grad(out64, leaves64, dout.double())
    low_leaves = [t.detach().clone().requires_grad_(True) for t in qkv]
    want_low = torch.autograd.grad(program.reference(*low_leaves, dtype=dtype, **kwargs), low_leaves, dout)
    error = 0.0
    for name, a, b, c, r in zip(("dq", "dk", "dv"), got, want64, want_low, rounding):
        assert_matches_reference(a, b, c, dtype, what=f"{name} of {what}", rounding=r)
        finite = torch.isfinite(b)
        if finite.any():
            error = max(error, (a.double() - b)[finite].abs().max().item())
    return error


def record(results: list[dict], failed: set[str], run: dict) -> dict:
    """The record of the instances all of whose cases passed (``failed``: keys with a failing case)."""
    passed: dict[str, dict] = {}
    for r in results:
        entry = passed.setdefault(r["key"], {"key": r["key"], "cases": 0, "max_error": 0.0})
        entry["cases"] += 1
        error = r["max_error"]
        entry["max_error"] = max(entry["max_error"], error) if math.isfinite(error) else math.inf
    instances = [e for k, e in sorted(passed.items()) if k not in failed and math.isfinite(e["max_error"])]
    return {
        "about": "Template instances verified against the float64 reference on a GPU: written by "
        "`python -m attnfuse.kernels.verify --write`, never by hand.",
        "run": run,
        "instances": instances,
    }


def instance_keys() -> dict[tuple[str, str, str, int, bool], str]:
    """The record key of the instance that each (kind, variant, dtype, head dim, with dropout) of the cases runs,
    computed on the CPU from the variant's sm90 plan."""
    from .resources import variant_plan

    keys = {}
    for case in cases() + backward_cases():
        dropout = bool(case.dropout)
        plan = variant_plan(case.variant, case.dtype, case.head_dim, dropout=dropout)
        spec = plan.templates.kernels[case.kind]
        keys[(case.kind, case.variant, case.dtype, case.head_dim, dropout)] = record_key(
            spec, case.dtype, case.head_dim
        )
    return keys


def print_keys() -> None:
    for (kind, variant, dtype, head_dim, dropout), key in sorted(instance_keys().items()):
        state = "verified" if is_verified(key) else "not verified"
        name = f"{variant}+dropout" if dropout else variant
        print(f"{kind:8} {name:16} {dtype:9} D{head_dim:<4} {key}  {state}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--collect", type=Path, help="the directory the GPU tests wrote")
    what.add_argument("--keys", action="store_true", help="print each case's instance and whether it is verified")
    parser.add_argument("--write", type=Path, default=RECORD, help="the record to write")
    args = parser.parse_args()
    if args.keys:
        print_keys()
        return
    results, failed = [], set()
    for path in sorted(args.collect.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            (failed.add(r["key"]) if r.get("failed") else results.append(r))
    run = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
    }
    data = record(results, failed, run)
    args.write.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['instances'])} instances verified, {len(failed)} with a failing case; written to {args.write}")


if __name__ == "__main__":
    main()
