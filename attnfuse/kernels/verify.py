"""The GPU check of the template instances against the float64 reference, and the record it writes.

``tests/test_template_gpu.py`` runs ``check`` on every case of ``cases()`` (each built-in and installed contrib
variant, head dims 64/128/256, float16 and bfloat16, GQA, lengths that are not multiples of a tile, Nq != Nk,
non-finite values under the masks) with ``ATTNFUSE_TEMPLATES=all``, and appends each result to a file in
``$ATTNFUSE_VERIFY_OUT``. Then

    python -m attnfuse.kernels.verify --collect $ATTNFUSE_VERIFY_OUT --write attnfuse/kernels/verified.json

writes the record (``verified.py``): every instance each of whose cases ran and passed, and no other.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
from pathlib import Path
from typing import Callable

import torch
from attrs import frozen

import attnfuse as af
from ..testing.tolerances import assert_matches_reference
from .launch import TemplateForward
from .verified import MODE_ENV, RECORD

OUT_ENV = "ATTNFUSE_VERIFY_OUT"
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
SHAPES = ((2, 4, 2, 300, 300), (1, 2, 2, 130, 257))  # (B, Hq, Hkv, Nq, Nk): GQA; ragged, fewer queries
HOISTED_SHAPES = ((1, 4, 2, 600, 600), (1, 2, 2, 520, 700))  # enough query blocks that a qk transform is hoisted


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

    @property
    def id(self) -> str:
        B, Hq, Hkv, Nq, Nk = self.shape
        return f"{self.variant}-D{self.head_dim}-{self.dtype}-{B}x{Hq}x{Hkv}x{Nq}x{Nk}{'-nan' if self.poison else ''}"


def cases() -> list[Case]:
    def shapes(v: str) -> tuple:
        return HOISTED_SHAPES if v.startswith("rope") else SHAPES

    found = [Case(v, d, t, s, False) for v in VARIANTS for d in HEAD_DIMS for t in DTYPES for s in shapes(v)]
    masked = ("causal", "sliding_window", "causal_alibi", "relu", "sigmoid")
    found += [Case(v, d, "bfloat16", SHAPES[0], True) for v in masked if v in VARIANTS for d in HEAD_DIMS]
    return found


def check(case: Case, seed: int = 0) -> dict:
    """Run ``case`` through its template instance on the GPU and compare out and lse with the float64 reference
    (AssertionError if they differ beyond what the dtype allows, or if the template did not run); its result."""
    program, extra = VARIANTS[case.variant]
    B, Hq, Hkv, Nq, Nk = case.shape
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, case.head_dim, device="cuda", dtype=dtype, generator=gen) for h, n in
               ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))  # fmt: skip
    if case.poison:  # rows before position 2 Nk / 3 (causal), or past it by more than a window, mask this key
        v[:, :, 2 * Nk // 3, ::3] = float("nan")
    kwargs = extra(Hq, Nq, Nk, "cuda")
    if os.environ.get(MODE_ENV) != "all":
        raise RuntimeError(f"the check runs the template instances: set {MODE_ENV}=all")
    before = TemplateForward.launches
    if program.graph(**kwargs).has_lse:
        out, lse = program(q, k, v, return_lse=True, **kwargs)
    else:
        out, lse = program(q, k, v, **kwargs), None
    if TemplateForward.launches == before:
        raise AssertionError(f"{case.id}: the call did not run the forward template")
    ref = program.reference(q, k, v, return_lse=lse is not None, **kwargs)
    low = program.reference(q, k, v, return_lse=lse is not None, dtype=dtype, **kwargs)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collect", type=Path, required=True, help="the directory the GPU tests wrote")
    parser.add_argument("--write", type=Path, default=RECORD, help="the record to write")
    args = parser.parse_args()
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
