"""The GPU check of the template instances against the float64 reference, and the record it writes.

``tests/test_template_gpu.py`` runs ``check`` on every case of ``cases()`` (the forward template: each built-in
and installed contrib variant, head dims 64/128/256, float16 and bfloat16, GQA, lengths that are not multiples
of a tile, Nq != Nk, non-finite values under the masks; calls with a fact, ``fact_cases()``: per-sequence key
counts, given positions, packed sequences; ``DROPOUT_VARIANTS`` with attention dropout; float8 calls,
``fp8_cases()``, checked by ``verify_fp8``) and of ``backward_cases()``
(the dK/dV and the dQ templates: their gradients dq, dk, dv through the public API; the dK/dV template's with
attention dropout too) with ``ATTNFUSE_TEMPLATES=all`` (and ``ATTNFUSE_DROPOUT_ON_GPU=1``), and appends each
result to a file in ``$ATTNFUSE_VERIFY_OUT``. A dropout case compares with the float64 reference replaying the
call's mask (``af.dropout_keep``). Then

    python -m attnfuse.kernels.verify --collect $ATTNFUSE_VERIFY_OUT --write attnfuse/kernels/verified.json

writes the record (``verified.py``): every instance each of whose cases ran and passed, and no other.
``python -m attnfuse.kernels.verify --keys`` prints, with no GPU, the instance each variant's cases run and
whether the record holds it: what a change to the templates or to a fragment un-verified.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import warnings
from pathlib import Path
from typing import Callable

import torch
from attrs import frozen

import attnfuse as af
from ..passes.compiler import compile as compile_plan
from ..plan import KernelConfig, Plan
from ..runtime import packed
from ..testing.grad_bounds import delta_rounding
from ..runtime.dropout import GATE as DROPOUT_GATE
from ..runtime.launch import clear_cache
from ..testing.tolerances import assert_matches_reference
from .capability import FORWARD_FP8_HEAD_DIMS
from .dq_launch import TemplateDq
from .launch import TemplateDkdv, TemplateForward
from .verified import MODE_ENV, RECORD, is_verified, record_key
from .verify_fp8 import FP8_DTYPES, check_fp8

OUT_ENV = "ATTNFUSE_VERIFY_OUT"
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
SHAPES = ((2, 4, 2, 300, 300), (1, 2, 2, 130, 257))  # (B, Hq, Hkv, Nq, Nk): GQA; ragged, fewer queries
HOISTED_SHAPES = ((1, 4, 2, 600, 600), (1, 2, 2, 520, 700))  # enough query blocks that a qk transform is hoisted
DKDV_HEAD_DIMS = (64, 128)  # the dK/dV template's (``tiles.DKDV_TILES``) and the dQ template's (``DQ_TILES``)
BACKWARD_TEMPLATES = {"dkdv": TemplateDkdv, "dq": TemplateDq}  # the backward's templates, by case kind
# A call's facts (``forward_facts.py``), each with its cases' shape (B, Hq, Hkv, Nq, Nk):
KV_LENS_SHAPE = (3, 4, 2, 130, 300)  # kv_lens (0, 300, 77): none, more than a tile, off the tiles
KV_LENS = (0, 300, 77)
POSITIONS_SHAPE = (2, 4, 2, 130, 257)  # queries at 140.., keys at 200..: the first 60 rows keep no causal key
HOISTED_POSITIONS_SHAPE = (1, 4, 2, 520, 700)  # enough query blocks that a qk transform is hoisted
POSITIONS = {"q_offset": 140, "k_offset": 200, "seq_len": 1000}
# packed documents' lengths (q, k): empty, of one row, off the tiles, rows with no key, more queries than keys
DOCUMENTS = ((0, 5), (1, 1), (130, 130), (64, 0), (200, 257), (7, 70), (300, 128), (0, 9))
PACKED_SHAPE = (1, 4, 2, sum(q for q, _ in DOCUMENTS), sum(k for _, k in DOCUMENTS))
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
LISTED_BLOCK = 256  # the random block grid's block size: two or four template tiles of keys a listed block


def _random_blocks(hq: int, nq: int, nk: int, device) -> dict:
    """A block grid of LISTED_BLOCK blocks, random per head (seeded by the shape): head 0's last query block
    lists nothing (its rows get the normaliser's init), every other head's lists the last key block (ragged where
    Nk is not a multiple of the block)."""
    gen = torch.Generator().manual_seed(nq * 7919 + nk)
    active = torch.rand(1, hq, -(-nq // LISTED_BLOCK), -(-nk // LISTED_BLOCK), generator=gen) < 0.6
    active[:, 1:, :, -1] = True
    active[:, 0, -1] = False
    return {"block_mask": af.BlockMask.from_blocks(active.to(device), nq, nk, block_size=LISTED_BLOCK)}


def _document_tokens(hq: int, nq: int, nk: int, device) -> dict:
    """A token-level block mask of 128 blocks: documents of 200 tokens and 16 global keys, so the lists hold full
    blocks, partial ones (their token masks applied) and leave blocks out."""
    with warnings.catch_warnings():  # create_block_mask's one-release notice of its per-token predicate
        warnings.simplefilter("ignore", DeprecationWarning)
        mask = af.create_block_mask(
            lambda b, h, q, k: (q // 200 == k // 200) | (k < 16), None, hq, nq, nk, block_size=128, device=device
        )
    return {"block_mask": mask}


def _listed_variants() -> dict[str, tuple[Callable, Callable]]:
    """name -> (program, its runtime arguments): programs whose mask lists its blocks, which the templates
    follow."""
    return {
        "block_sparse": (
            af.attention(
                lambda q, k, v, block_mask: af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v
            ),
            _random_blocks,
        ),
        "block_sparse_tokens": (
            af.attention(
                lambda q, k, v, block_mask: (
                    af.softmax(af.block_sparse(af.causal(af.scaled_dot_product(q, k)), block_mask)) @ v
                )
            ),
            _document_tokens,
        ),
    }


LISTED_VARIANTS = _listed_variants()
FORWARD_VARIANTS = {**VARIANTS, **LISTED_VARIANTS}  # the forward template's: every variant, and the listed ones
# checked with float8 q, k, v: the variants whose normaliser saves lse (weights of at most 1 summing to at least 1,
# the bound of ``verify_fp8``) and that run the template (a qk transform runs inside a float8 call's kernel)
FP8_VARIANTS = tuple(
    v
    for v, (program, extra) in FORWARD_VARIANTS.items()
    if not v.startswith("rope") and program.graph(**extra(1, 1, 1, "cpu")).has_lse
)


@frozen
class Case:
    variant: str
    head_dim: int
    dtype: str
    shape: tuple[int, int, int, int, int]
    poison: bool  # a NaN value that some rows mask and the others keep: the careful redo must sort them out
    kind: str = "forward"  # the template checked: "forward" (out, lse), "dkdv" or "dq" (the gradients)
    fact: str = ""  # the call's fact: "kv_lens", "positions" or "varlen" (``fact_cases``), or none
    dropout: float = 0.0  # the call's dropout_p: its instance is the program's instance with dropout
    out_dtype: str = ""  # a float8 call's out_dtype ("": its default, bfloat16)

    @property
    def id(self) -> str:
        B, Hq, Hkv, Nq, Nk = self.shape
        kind = "" if self.kind == "forward" else f"{self.kind}-"
        shape = f"{B}x{Hq}x{Hkv}x{Nq}x{Nk}"
        fact = f"-{self.fact}" if self.fact else ""
        dropout = f"-dropout{self.dropout}" if self.dropout else ""
        out = f"-out-{self.out_dtype}" if self.out_dtype else ""
        return (
            f"{kind}{self.variant}-D{self.head_dim}-{self.dtype}-{shape}{fact}{'-nan' if self.poison else ''}{dropout}"
            f"{out}"
        )


def _shapes(variant: str) -> tuple:
    return HOISTED_SHAPES if variant.startswith("rope") else SHAPES


def cases() -> list[Case]:
    """The forward template's cases."""
    found = [Case(v, d, t, s, False) for v in FORWARD_VARIANTS for d in HEAD_DIMS for t in DTYPES for s in _shapes(v)]
    masked = ("causal", "sliding_window", "causal_alibi", "relu", "sigmoid", *LISTED_VARIANTS)
    found += [Case(v, d, "bfloat16", SHAPES[0], True) for v in masked if v in FORWARD_VARIANTS for d in HEAD_DIMS]
    return found + fact_cases() + _dropout_cases("forward") + fp8_cases()


def fp8_cases() -> list[Case]:
    """The forward template's float8 cases: ``FP8_VARIANTS`` at its float8 head dims in either float8 type (once
    with a NaN value: the careful redo's); in e4m3 (the same instance, other descriptors), at head dim 128 with
    each other out_dtype (float16, float32), and of calls with kv_lens (NaN keys and values past each sequence's
    length), given positions or packed sequences, as ``fact_cases`` (not the listed variants: the template follows
    block lists only in a call with no fact)."""
    e4m3 = FP8_DTYPES[0]
    found = [
        Case(v, d, dtype, shape, poison)
        for dtype in FP8_DTYPES
        for v in FP8_VARIANTS
        for d in FORWARD_FP8_HEAD_DIMS
        for shape, poison in ((SHAPES[0], False), (SHAPES[1], False), (SHAPES[0], True))
    ]
    found += [
        Case(v, d, e4m3, shape, fact == "kv_lens", fact=fact)
        for fact, shape in (("kv_lens", KV_LENS_SHAPE), ("positions", POSITIONS_SHAPE), ("varlen", PACKED_SHAPE))
        for v in FP8_VARIANTS
        if v in VARIANTS and _takes(v, fact)
        for d in FORWARD_FP8_HEAD_DIMS
    ]
    return found + [
        Case(v, 128, e4m3, SHAPES[0], False, out_dtype=out) for v in FP8_VARIANTS for out in ("float16", "float32")
    ]


def _takes(variant: str, fact: str) -> bool:
    """Whether ``variant`` has cases of calls with ``fact``: a qk transform (rope) runs hoisted into a pass only
    with one length for all sequences (not kv_lens), and a packed call's hoisted instance is the same code as
    causal's (checked by causal's cases); a packed sigmoid call's default offset is -log of the packed key count,
    not each document's, so it is not each document alone."""
    if variant.startswith("rope"):
        return fact == "positions"
    return fact != "varlen" or variant != "sigmoid"


def fact_cases() -> list[Case]:
    """The forward template's cases of calls with a fact: each variant that takes it (not the listed ones: the
    template follows block lists only in a call with no fact, ``capability.forward_reason``), at every head dim
    and dtype. kv_lens: NaN keys and values past each sequence's length (the cache's unused rows)."""
    shapes = {
        "kv_lens": lambda v: KV_LENS_SHAPE,
        "positions": lambda v: HOISTED_POSITIONS_SHAPE if v.startswith("rope") else POSITIONS_SHAPE,
        "varlen": lambda v: PACKED_SHAPE,
    }
    return [
        Case(v, d, t, shape(v), fact == "kv_lens", fact=fact)
        for fact, shape in shapes.items()
        for v in VARIANTS
        if _takes(v, fact)
        for d in HEAD_DIMS
        if fact != "varlen" or _packed_served("forward", v, d)
        for t in DTYPES
    ]


@functools.cache
def _packed_served(kind: str, variant: str, head_dim: int) -> bool:
    """Whether the ``kind`` template runs a packed call of ``variant`` at ``head_dim`` (``capability``: one reading
    a tensor at packed rows, not at every head dim and not in the dK/dV template yet)."""
    return kind in variant_plan(variant, "bfloat16", head_dim, "varlen").templates.kernels


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
    """Whether the variant's normaliser has smooth weights (``NormaliserFragment.smooth``): a non-smooth one's
    (relu's) backward cases draw q and k whose scores are exact (``exact_scores``)."""
    program, extra = FORWARD_VARIANTS[variant]
    return program.graph(**extra(1, 1, 1, "cpu")).weights.apply.fragment().smooth


def exact_scores(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (..., Nq, D) and k (..., Nk, D) of any dtype -> q and k, of that dtype, whose every product q·k is exact
    in float16 or bfloat16 inputs with float32 sums, and never 0: small integers, q's first column plus 1/2 and k's
    first column odd, so each q·k is an integer plus an odd number of halves. Where a normaliser's weights jump
    (relu's at a score of 0), the kernel and the float64 reference then keep every score on the same side, and
    their gradients are compared as a smooth normaliser's are."""
    q, k = (x.mul(2).round().clamp(-4, 4) for x in (q, k))
    q[..., 0] += 0.5
    k[..., 0] = 2 * k[..., 0].div(2).floor() + 1  # odd, within [-3, 5]
    return q, k


def backward_cases() -> list[Case]:
    """The dK/dV and dQ templates' cases: each variant (a non-smooth normaliser's on ``exact_scores``), the listed
    ones (``LISTED_VARIANTS``) included, their head dims, both dtypes, the forward's shapes; both with attention
    dropout, ``DROPOUT_VARIANTS``; and packed calls (``_packed_backward_cases``). None with NaN values: a masked
    key's NaN value makes the float64 reference's gradients NaN (its masked weights' dS is 0 · NaN), where the
    kernels' are 0."""
    return [
        Case(v, d, t, s, False, kind=kind)
        for kind in BACKWARD_TEMPLATES
        for v in FORWARD_VARIANTS
        for d in DKDV_HEAD_DIMS
        for t in DTYPES
        for s in _shapes(v)
    ] + [case for kind in BACKWARD_TEMPLATES for case in _dropout_cases(kind) + _packed_backward_cases(kind)]


def _packed_backward_cases(kind: str) -> list[Case]:
    """``kind``'s cases of packed calls: each variant that the forward template runs packed
    (``_takes``) and the ``kind`` template takes (``_packed_served``), the forward's packed shape."""
    return [
        Case(v, d, t, PACKED_SHAPE, False, kind=kind, fact="varlen")
        for v in VARIANTS
        if _takes(v, "varlen")
        for d in DKDV_HEAD_DIMS
        if _packed_served(kind, v, d)
        for t in DTYPES
    ]


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


def poison(v: torch.Tensor) -> None:
    """Make a third of key 2 Nk / 3's values in v (B, Hkv, Nk, D) NaN: rows before that position (causal), or past
    it by more than a window, mask the key; the others keep it, and their out is NaN in those columns."""
    v[:, :, 2 * v.shape[2] // 3, ::3] = float("nan")


def check(case: Case, seed: int = 0) -> dict:
    """Run ``case`` through its template instance on the GPU and compare out and lse (or, for a dK/dV or dQ
    case, the gradients) with the float64 reference (AssertionError if they differ beyond what the dtype allows, or
    if the template did not run); its result."""
    if case.kind in BACKWARD_TEMPLATES:
        return _check_backward(case, seed)
    program, extra = FORWARD_VARIANTS[case.variant]
    B, Hq, Hkv, Nq, Nk = case.shape
    if case.dtype in FP8_DTYPES:
        _environment(case)
        out_dtype = getattr(torch, case.out_dtype or "bfloat16")
        with _packed_on_gpu(case.fact == "varlen"):
            return check_fp8(
                program,
                extra(Hq, Nq, Nk, "cuda"),
                case.shape,
                case.head_dim,
                seed,
                case.id,
                getattr(torch, case.dtype),
                out_dtype,
                poisoned(case),
                fact_arguments(case.fact, torch.device("cuda")),
            )
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, case.head_dim, device="cuda", dtype=dtype, generator=gen) for h, n in
               ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))  # fmt: skip
    facts = fact_arguments(case.fact, q.device)
    if (poison_kv := poisoned(case)) is not None:
        poison_kv(k, v)
    kwargs = extra(Hq, Nq, Nk, "cuda")
    _environment(case)
    before = TemplateForward.launches
    with_lse = program.graph(**kwargs).has_lse
    with _packed_on_gpu(case.fact == "varlen"), replayed_dropout(case, seed, (B, Hq, Nq, Nk), q.device) as calls:
        dropout, replayed = calls
        out = program(q, k, v, return_lse=with_lse, **kwargs, **facts, **dropout)
    out, lse = out if with_lse else (out, None)
    if TemplateForward.launches == before:
        raise AssertionError(f"{case.id}: the call did not run the forward template")
    if case.fact == "varlen":
        ref = packed_reference(program, q, k, v, return_lse=with_lse, **kwargs)
        low = packed_reference(program, q, k, v, return_lse=with_lse, dtype=dtype, **kwargs)
    else:
        ref = program.reference(q, k, v, return_lse=with_lse, **kwargs, **facts, **replayed)
        low = program.reference(q, k, v, return_lse=with_lse, dtype=dtype, **kwargs, **facts, **replayed)
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


def poisoned(case: Case) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """What writes ``case``'s NaN values into its k and v (B, Hkv, Nk, D), if it has any: with kv_lens, every
    key and value past each sequence's length (the cache's rows that are no keys of it), else ``poison``'s."""
    if not case.poison:
        return None
    if case.fact == "kv_lens":

        def past_lengths(k: torch.Tensor, v: torch.Tensor) -> None:
            for b, n in enumerate(KV_LENS):
                k[b, :, n:] = v[b, :, n:] = float("nan")

        return past_lengths
    return lambda k, v: poison(v)


def fact_arguments(fact: str, device: torch.device) -> dict:
    """The call's arguments of ``fact`` (``fact_cases``), tensors on ``device``: kv_lens ``KV_LENS``, the
    positions ``POSITIONS``, or the offsets of the packed ``DOCUMENTS``; none for no fact."""
    if fact == "kv_lens":
        return {"kv_lens": torch.tensor(KV_LENS, dtype=torch.int32, device=device)}
    if fact == "positions":
        return dict(POSITIONS)
    if fact == "varlen":
        offsets = [[0, *torch.tensor(n).cumsum(0).tolist()] for n in zip(*DOCUMENTS)]
        cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device=device) for o in offsets)
        return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    return {}


@contextlib.contextmanager
def _packed_on_gpu(asked: bool):
    """Packed calls on the GPU, where ``asked``, for the time of the block (``runtime/packed.py``'s gate: its
    kernels run by default only on the architectures a GPU run has checked them on)."""
    before = os.environ.get(packed.GATE.env)
    if asked:
        os.environ[packed.GATE.env] = "1"
    try:
        yield
    finally:
        if asked and before is None:
            del os.environ[packed.GATE.env]
        elif asked:
            os.environ[packed.GATE.env] = before


def packed_reference(program, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool = False, **options):
    """``program.reference`` of a packed call of ``DOCUMENTS`` (q (1, Hq, total_q, D), k and v (1, Hkv, total_k,
    D)): each document attending within itself at its own positions, a tensor indexed by query and key read at
    packed rows (the evaluator's packed call, which ``tests/test_kit_packed.py`` checks against each document run
    alone); out, or (out, lse)."""
    return program.reference(q, k, v, return_lse=return_lse, **fact_arguments("varlen", q.device), **options)


def _check_backward(case: Case, seed: int) -> dict:
    """Forward and backward through the public API (the dK/dV template's instance computes dk and dv, the dQ
    template's dq and delta, each where the templates can run the program); dq, dk and dv against the float64
    reference's gradients, with the bound of delta's rounding (``grad_bounds``) for normalisers that read delta.
    AssertionError too if the case's template (``case.kind``) did not run."""
    template = BACKWARD_TEMPLATES[case.kind]
    program, extra = FORWARD_VARIANTS[case.variant]
    B, Hq, Hkv, Nq, Nk = case.shape
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, case.head_dim, device="cuda", dtype=dtype, generator=gen) for h, n in
               ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))  # fmt: skip
    dout = torch.randn(B, Hq, Nq, case.head_dim, device="cuda", dtype=dtype, generator=gen)
    if not smooth(case.variant):
        q, k = exact_scores(q, k)
    kwargs = extra(Hq, Nq, Nk, "cuda")
    facts = fact_arguments(case.fact, q.device)
    _environment(case)
    before = template.launches
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with (
        _only_unverified(case.kind),
        _packed_on_gpu(case.fact == "varlen"),
        replayed_dropout(case, seed, (B, Hq, Nq, Nk), q.device) as (dropout, replayed),
    ):
        got = torch.autograd.grad(program(*leaves, **kwargs, **facts, **dropout), leaves, dout)
    if template.launches == before:
        raise AssertionError(f"{case.id}: the call did not run the {case.kind} template")
    documents = case.fact == "varlen"
    error = compare_gradients(program, kwargs, (q, k, v), dout, got, case.id, replayed, documents=documents)
    return {"key": template.last_key, "case": case.id, "max_error": error}


@contextlib.contextmanager
def _only_unverified(kind: str):
    """Calls that run the unverified instances of ``kind`` (and the forward's) alone, the other backward kernel's
    only where verified: a dK/dV case checks the dK/dV instance, not an unverified dQ instance beside it."""
    clear_cache()
    os.environ[MODE_ENV] = f"forward,{kind}"
    try:
        yield
    finally:
        os.environ[MODE_ENV] = "all"
        clear_cache()


def compare_gradients(
    program,
    kwargs: dict,
    qkv: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    got: tuple[torch.Tensor, ...],
    what: str,
    dropout: dict | None = None,
    documents: bool = False,
) -> float:
    """Compare ``got`` (dq, dk, dv of ``program`` at q, k, v = ``qkv`` for the output gradient ``dout``, all of
    one dtype) with the float64 reference's gradients (AssertionError beyond what the dtype allows, with the
    bound of delta's rounding, ``grad_bounds``, for a normaliser that reads delta); the largest error.
    ``dropout``: the call's ``dropout_p`` and replayed ``dropout_mask``, for the reference (None: none);
    ``documents``: a packed call of ``DOCUMENTS`` (its reference: ``packed_reference``)."""
    dtype = dout.dtype
    graph = program.graph(**kwargs)
    kwargs = {**kwargs, **(dropout or {})}
    reference = functools.partial(packed_reference, program) if documents else program.reference
    leaves64 = [t.detach().double().requires_grad_(True) for t in qkv]
    if graph.has_lse:
        out64, lse64 = reference(*leaves64, return_lse=True, **kwargs)
    else:
        out64, lse64 = reference(*leaves64, **kwargs), None
    rounding = [None] * 3
    if lse64 is not None and graph.weights.apply.fragment().needs_delta:
        q, k, v = (t.detach().double() for t in qkv)
        with torch.no_grad():
            weighted = reference(q, k, v.abs(), return_lse=True, **kwargs)[0]
        rounding = delta_rounding(lse64, out64, weighted, dout, leaves64, dtype)
    want64 = torch.autograd.grad(out64, leaves64, dout.double())
    low_leaves = [t.detach().clone().requires_grad_(True) for t in qkv]
    want_low = torch.autograd.grad(reference(*low_leaves, dtype=dtype, **kwargs), low_leaves, dout)
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


def added(earlier: dict, new: dict, failed: set[str]) -> dict:
    """``earlier``'s record with ``new``'s instances added (a new entry replaces an earlier one of its key) and
    those of ``failed`` keys taken out; each entry names the run it comes from (``runs``, in order)."""
    runs = earlier.get("runs") or [earlier["run"]]
    instances = {e["key"]: {"run": 0, **e} for e in earlier["instances"] if e["key"] not in failed}
    instances.update({e["key"]: {**e, "run": len(runs)} for e in new["instances"]})
    return {
        "about": new["about"],
        "runs": [*runs, new["run"]],
        "instances": [instances[k] for k in sorted(instances)],
    }


def pruned(earlier: dict, keys: set[str]) -> dict:
    """``earlier``'s record with only the instances of ``keys`` (those the cases run now: an instance whose
    source changed has a new key) and the runs they come from."""
    instances = [e for e in earlier["instances"] if e["key"] in keys]
    runs = earlier.get("runs")
    if runs is None:
        return {**earlier, "instances": instances}
    kept = sorted({e["run"] for e in instances})
    renumbered = {old: new for new, old in enumerate(kept)}
    return {
        "about": earlier["about"],
        "runs": [runs[i] for i in kept],
        "instances": [{**e, "run": renumbered[e["run"]]} for e in instances],
    }


def variant_plan(variant: str, dtype: str, head_dim: int, fact: str = "", dropout: bool = False) -> Plan:
    """The sm90 plan of ``FORWARD_VARIANTS[variant]`` (GQA group 2; the hoisted plan, which is the one that
    runs the template, where the program's transforms are hoisted) for a call with ``fact`` ("kv_lens",
    "positions" or "varlen": ``fact_cases``), or none, and with attention dropout if ``dropout``."""
    program, extra = FORWARD_VARIANTS[variant]
    graph = program.graph(**extra(4, 64, 64, "cpu"))
    config = KernelConfig(
        arch="sm90",
        dtype=dtype,
        head_dim=head_dim,
        head_dim_v=head_dim,
        group=2,
        save_lse=graph.has_lse,
        fp32_precision="ieee",
        **({fact: True} if fact else {}),
        dropout=dropout,
    )
    plan = compile_plan(graph, config)
    return plan if "transform" not in plan.kernels else compile_plan(graph, plan.hoisted_config)


def instance_keys() -> dict[tuple[str, str, str, int], str]:
    """The record key of the instance that each (kind, variant, dtype, head dim) of the cases runs, computed on
    the CPU from the variant's sm90 plan; a case with a fact names its variant ``variant+fact``, one with
    attention dropout ``variant+dropout``."""
    keys = {}
    for case in cases() + backward_cases():
        plan = variant_plan(case.variant, case.dtype, case.head_dim, case.fact, dropout=bool(case.dropout))
        spec = plan.templates.kernels[case.kind]
        variant = "+".join([case.variant] + [case.fact] * bool(case.fact) + ["dropout"] * bool(case.dropout))
        keys[(case.kind, variant, case.dtype, case.head_dim)] = record_key(spec, case.dtype, case.head_dim)
    return keys


def print_keys() -> None:
    for (kind, variant, dtype, head_dim), key in sorted(instance_keys().items()):
        state = "verified" if is_verified(key) else "not verified"
        print(f"{kind:8} {variant:16} {dtype:9} D{head_dim:<4} {key}  {state}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--collect", type=Path, help="the directory the GPU tests wrote")
    what.add_argument("--keys", action="store_true", help="print each case's instance and whether it is verified")
    what.add_argument(
        "--prune", action="store_true", help="drop from the record (--write) the instances no case runs any more"
    )
    parser.add_argument("--write", type=Path, default=RECORD, help="the record to write")
    parser.add_argument(
        "--add-to",
        type=Path,
        help="a record whose instances this run adds to (a run of some cases: TEMPLATES_K); an instance with a "
        "failing case in this run leaves it",
    )
    args = parser.parse_args()
    if args.keys:
        print_keys()
        return
    if args.prune:
        earlier = json.loads(args.write.read_text())
        data = pruned(earlier, set(instance_keys().values()))
        args.write.write_text(json.dumps(data, indent=1) + "\n")
        print(f"{len(earlier['instances']) - len(data['instances'])} instances no case runs dropped from {args.write}")
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
    if args.add_to is not None:
        data = added(json.loads(args.add_to.read_text()), data, failed)
    args.write.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['instances'])} instances verified, {len(failed)} with a failing case; written to {args.write}")


if __name__ == "__main__":
    main()
