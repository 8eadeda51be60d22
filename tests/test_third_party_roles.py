"""A third party can add a combinator of any role without touching AttnFuse's core.

The built-ins cover score sources, score modifications, masks and normalisers. This file declares, as a
third party would, one plugin for each role left:

Their names start with ``_test_`` so that an installed package providing the real thing (say a
``sigmoid_attention``) cannot clash with them:

* ``qk_norm(q, k)``: a qk transform, L2-normalising every row of q and of k over the head dim (QK-norm);
* ``document(s, doc_ids)``: a mask reading a runtime tensor, keeping keys of the query's own document;
* ``sigmoid_attention(s, bias=None)``: a normaliser, weights sigmoid(s + bias) with no normalisation.

Each is registered from code (``attnfuse.register_plugin``), only for the duration of this module, and is
checked by the conformance fuzzer (which composes it with every other registered combinator) and on a
fixed program against the float64 reference.
"""

from __future__ import annotations

import math
import os
import zlib

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.checks import finite_number_or_none
from attnfuse.combinator import (
    Combinator,
    MaskFragment,
    NormaliserFragment,
    Param,
    QKTransformFragment,
    Role,
    ScalarArg,
    TensorArg,
)
from attnfuse.errors import InputError
from attnfuse.testing import assert_matches_reference, check_combinator

from conftest import hoisted_last_call, plan_setting

FUZZ_EXAMPLES = int(os.environ.get("ATTNFUSE_FUZZ_EXAMPLES", "6"))
# Fixed programs run on the CPU (Triton's interpreter) always, and compiled on a GPU when there is one.
CASES = [pytest.param("cpu", dtype, id=f"cpu-{str(dtype)[6:]}") for dtype in (torch.float32, torch.float16)]
if torch.cuda.is_available():
    CASES += [
        pytest.param("cuda", dtype, id=f"cuda-{str(dtype)[6:]}")
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    ]


# ---------------------------------------------------------------------------------------------------------
# (a) qk_norm: a qk transform.


def qk_norm_reference(q, k, ctx):
    """q (B, Hq, Nq, D), k (B, Hq, Nk, D) -> each row divided by max(its L2 norm, 1e-12)."""
    return torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)


# The kernel hands a qk transform the tile as its two halves $x1, $x2: float32 (rows, BLOCK_H), columns
# [0, D/2) and [D/2, D). Padding columns (beyond D/2 in each half) were loaded as 0, so they add nothing.
# Temporaries are named ${tmp}_<name>: the q site (before the key loop, BLOCK_M rows) and the k site (inside
# it, BLOCK_N rows) get different $tmp, since compiled Triton refuses a loop-carried variable that changes
# shape.
_L2_NORMALISE = """
    ${tmp}_norm = tl.maximum(tl.sqrt(tl.sum($x1 * $x1, 1) + tl.sum($x2 * $x2, 1)), 1e-12)[:, None]
    $x1 = $x1 / ${tmp}_norm
    $x2 = $x2 / ${tmp}_norm
"""

QK_NORM = Combinator(
    name="_test_qk_norm",
    role=Role.QK_TRANSFORM,
    doc="QK-norm: L2-normalise every row of q and of k over the head dim.",
    reference=qk_norm_reference,
    fragment=QKTransformFragment(q=_L2_NORMALISE, k=_L2_NORMALISE),
)


# ---------------------------------------------------------------------------------------------------------
# (b) document: a mask reading a runtime tensor.


def _doc_ids(doc_ids, B: int, Nk: int) -> torch.Tensor:
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dtype not in (torch.int32, torch.int64):
        raise InputError(
            f"_test_document: doc_ids must be an int32 or int64 tensor, "
            f"got {getattr(doc_ids, 'dtype', type(doc_ids).__name__)}"
        )
    if doc_ids.shape != (B, Nk):
        raise InputError(f"_test_document: doc_ids must have shape (B, Nk) = ({B}, {Nk}), got {tuple(doc_ids.shape)}")
    return doc_ids


def document_reference(ctx, doc_ids):
    """keep (B, 1, Nq, Nk): query i of sequence b, at position q' (i + Nk - Nq, or i + kv_lens[b] - Nq),
    keeps key j when doc_ids[b, q'] == doc_ids[b, j]. A query at a negative position belongs to no document
    and keeps nothing."""
    doc = _doc_ids(doc_ids, ctx.B, ctx.Nk).to(ctx.device)
    q_pos = ctx.q_pos[:, 0, :, 0].expand(ctx.B, -1)  # (B, Nq)
    if ctx.Nk == 0:
        return torch.zeros(ctx.B, 1, ctx.Nq, 0, dtype=torch.bool, device=ctx.device)
    q_doc = doc.gather(1, q_pos.clamp(min=0))  # (B, Nq); q' < Nk always
    return (q_doc[:, None, :, None] == doc[:, None, None, :]) & (q_pos >= 0)[:, None, :, None]


def document_prepare(ctx, doc_ids):
    return {"doc_ids": _doc_ids(doc_ids, ctx.B, ctx.Nk)}


def document_examples(draw, shape):
    from hypothesis import strategies as st

    seed = draw(st.integers(0, 2**31 - 1))
    ids = torch.randint(0, draw(st.integers(1, 4)), (shape.B, shape.Nk), generator=torch.Generator().manual_seed(seed))
    if draw(st.booleans()):  # packed sequences: each document one contiguous run
        ids = ids.sort(dim=-1).values
    return {"doc_ids": ids.to(draw(st.sampled_from([torch.int32, torch.int64])))}


DOCUMENT = Combinator(
    name="_test_document",
    role=Role.MASK,
    doc="Keep keys of the query's own document; doc_ids (B, Nk) gives each position's document.",
    params=[Param(name="doc_ids", runtime=True, doc="(B, Nk) int tensor: the document of each position")],
    reference=document_reference,
    tensors=[TensorArg(name="doc_ids", rank=2)],
    prepare=document_prepare,
    fragment=MaskFragment(
        # Keys load under in_bounds; queries only at valid positions 0 <= q' (q' < Nk iff q_idx < Nq).
        keep="""(
            (tl.load($doc_ids + b.to(tl.int64) * $doc_ids_s0 + k_pos[None, :] * $doc_ids_s1,
                     mask=in_bounds, other=0)
             == tl.load($doc_ids + b.to(tl.int64) * $doc_ids_s0 + q_pos[:, None] * $doc_ids_s1,
                        mask=(q_pos[:, None] >= 0) & (q_idx[:, None] < Nq), other=0))
            & (q_pos[:, None] >= 0))""",
    ),  # no block facts: kv_range and full_range unknown, so every block is visited and masked
    examples=document_examples,
)


# ---------------------------------------------------------------------------------------------------------
# (c) sigmoid_attention: a normaliser.


def _offset(bias, Nk: int) -> float:
    return -math.log(Nk) if bias is None else float(bias)


def sigmoid_reference(s, keep, ctx, bias):
    """s (B, Hq, Nq, Nk) -> weights sigmoid(s + bias), masked entries 0; no lse."""
    weights = torch.sigmoid(s + _offset(bias, max(ctx.Nk, 1)))
    if keep is not None:
        weights = weights.masked_fill(~keep, 0.0)
    return weights, None


def sigmoid_prepare(ctx, bias):
    """The default bias is -log(Nk): a packed call's documents each have their own Nk, so it is refused there
    (as the attnfuse-sigmoid package does); the conformance kit leaves such calls out."""
    if bias is None and ctx.cu_seqlens_k is not None:
        raise af.UnsupportedError("_test_sigmoid_attention: bias=None in a packed call; pass bias= explicitly")
    return {"offset": _offset(bias, max(ctx.Nk, 1))}


def sigmoid_examples(draw, shape):
    from hypothesis import strategies as st

    return {"bias": draw(st.sampled_from([None, 0.0, -2.0, 1.5]))}


SIGMOID_ATTENTION = Combinator(
    name="_test_sigmoid_attention",
    role=Role.NORMALISER,
    doc="Sigmoid attention: weights sigmoid(s + bias), bias defaulting to -log(Nk); not normalised.",
    params=[Param(name="bias", default=None, check=finite_number_or_none, doc="None means -log(Nk)")],
    reference=sigmoid_reference,
    scalars=[ScalarArg(name="offset")],
    prepare=sigmoid_prepare,
    fragment=NormaliserFragment(
        masked_score='float("-inf")',  # sigmoid(-inf) = 0
        init="",
        update="p = tl.sigmoid(s + $offset)",
        finalize="out = acc",
    ),
    examples=sigmoid_examples,
)


# ---------------------------------------------------------------------------------------------------------
# Registration, as a third party does from code.


class _Plugin:
    """A plugin object providing one combinator."""

    def __init__(self, combinator: Combinator):
        self.combinator = combinator

    @af.hookimpl
    def attnfuse_combinators(self):
        return [self.combinator]


PLUGINS = {f"third-party-test:{c.name}": c for c in (QK_NORM, DOCUMENT, SIGMOID_ATTENTION)}


@pytest.fixture(scope="module", autouse=True)
def third_party_plugins():
    registered = []
    try:
        for name, comb in PLUGINS.items():
            af.register_plugin(_Plugin(comb), name=name)
            registered.append(name)
        yield
    finally:
        for name in reversed(registered):
            af.unregister_plugin(name)


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_registered_from_code(plugin):
    comb = PLUGINS[plugin]
    entry = af.combinators()[comb.name]
    assert entry.combinator is comb
    assert entry.plugin == plugin
    assert entry.distribution == f"<registered in code: {plugin}>"
    assert getattr(af, comb.name).__name__ == comb.name


def _inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, n, D, generator=g).to(dtype).to(device) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _check(program, q, k, v, *extra, lse: bool = False):
    dtype = q.dtype
    got = program(q, k, v, *extra, return_lse=lse)
    ref64 = program.reference(q, k, v, *extra, return_lse=lse, dtype=torch.float64)
    ref_lowp = program.reference(q, k, v, *extra, return_lse=lse, dtype=dtype)
    if not lse:
        got, ref64, ref_lowp = (got,), (ref64,), (ref_lowp,)
    for what, a, r64, rlow in zip(("out", "lse"), got, ref64, ref_lowp):
        assert_matches_reference(a, r64, rlow, dtype, what=what)


SHAPES = [(2, 4, 2, 37, 53, 32), (1, 2, 1, 64, 64, 16), (1, 1, 1, 70, 20, 80)]
SHAPE_IDS = ["B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*s) for s in SHAPES]


# ---------------------------------------------------------------------------------------------------------
# (a) qk_norm


def test_qk_norm_conforms():
    check_combinator("_test_qk_norm", max_examples=FUZZ_EXAMPLES)


@af.attention
def qk_normed(q, k, v):
    s = af.scaled_dot_product(*af._test_qk_norm(q, k), scale=8.0)  # QK-norm needs a larger scale (a temperature)
    return af.softmax(af.causal(s)) @ v


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_qk_norm_fixed_program(device, dtype, shape):
    q, k, v = _inputs(*shape, dtype, seed=_seed("qk_norm", shape, dtype), device=device)
    q, k = q * 5, k * 0.3  # norms far from 1, so that normalising matters
    _check(qk_normed, q, k, v, lse=True)


def test_qk_norm_scores_are_cosines():
    """With scale 1 and relu_attention, out·Nk against v = I reads the scores: cosine similarities."""

    @af.attention
    def cosines(q, k, v):
        return af.relu_attention(af.scaled_dot_product(*af._test_qk_norm(q, k), scale=1.0)) @ v

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 24, 48, generator=g) * 3, torch.randn(1, 1, 32, 48, generator=g) * 0.1
    v = torch.eye(32)[None, None]
    got = (cosines(q, k, v) - cosines(-q, k, v)) * 32
    want = torch.nn.functional.cosine_similarity(q[0, 0, :, None, :], k[0, 0, None, :, :], dim=-1)
    torch.testing.assert_close(got[0, 0], want, atol=1e-5, rtol=1e-5)


def test_qk_norm_is_hoisted_like_rope():
    """A plugin's qk transform is hoisted into a transform pass as rope's is: each key's and query's L2
    norm runs once, and hoisted and fused outputs both match the reference."""
    from attnfuse.runtime import hoisted

    q, k, v = _inputs(1, 2, 1, 140, 150, 32, torch.float32, seed=_seed("qk_norm", "hoisted"), device="cpu")
    assert "qk transform of k" in qk_normed.source(q, k, v, kernel="transform")
    out = qk_normed(q, k, v)
    assert hoisted_last_call()
    _check(qk_normed, q, k, v, lse=True)
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 10**9):
        torch.testing.assert_close(out, qk_normed(q, k, v))
        assert not hoisted_last_call()
        _check(qk_normed, q, k, v, lse=True)


def test_qk_norm_is_a_pair_transform():
    """The DSL call returns the transformed (q, k) pair; v or scores are refused."""

    @af.attention
    def on_v(q, k, v):
        return af.softmax(af.scaled_dot_product(*af._test_qk_norm(q, v))) @ v

    with pytest.raises(af.ProgramError, match="_test_qk_norm"):
        on_v.graph()


# ---------------------------------------------------------------------------------------------------------
# (b) document


def test_document_conforms():
    check_combinator("_test_document", max_examples=FUZZ_EXAMPLES)


def test_a_packed_call_refuses_a_combinator_reading_indices_unless_it_declares_packed_rows():
    """_test_document indexes its tensor by positions and bounds q_idx by Nq: in a packed call its q_idx would be a
    packed row and Nq the document's length, so it is refused by name; additive_bias declares packed_rows."""
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    doc_ids = torch.zeros(1, 9, dtype=torch.int64)
    with pytest.raises(af.UnsupportedError, match=r"_test_document reads q_idx, .*declares packed_rows=True"):
        packed_bidirectional(q, k, v, doc_ids, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert af.combinators()["additive_bias"].combinator.packed_rows
    assert not af.combinators()["_test_document"].combinator.packed_rows
    with pytest.raises(af.PluginError, match="packed_rows must be True or False, got 'yes'"):
        attrs.evolve(af.combinators()["additive_bias"].combinator, packed_rows="yes")


@af.attention
def packed_causal(q, k, v, doc_ids):
    s = af.scaled_dot_product(q, k)
    s = af._test_document(af.causal(s), doc_ids)
    return af.softmax(s) @ v


@af.attention
def packed_bidirectional(q, k, v, doc_ids):
    return af.softmax(af._test_document(af.scaled_dot_product(q, k), doc_ids)) @ v


def _packed_doc_ids(B, Nk, seed, docs=3):
    """Packed sequences: B rows of `docs` contiguous documents of random lengths, as int32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, docs, (B, Nk), generator=g).sort(dim=-1).values.to(torch.int32)


@pytest.mark.parametrize("program", [packed_causal, packed_bidirectional], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_document_fixed_program(program, device, dtype, shape):
    q, k, v = _inputs(*shape, dtype, seed=_seed("document", shape, dtype), device=device)
    doc_ids = _packed_doc_ids(shape[0], shape[4], seed=_seed("doc_ids", shape)).to(device)
    _check(program, q, k, v, doc_ids, lse=True)


def test_document_mask_is_what_it_says():
    """Each output row is the softmax-average of the values of its own document's (earlier) keys only."""
    q, k, v = _inputs(1, 1, 1, 40, 40, 16, torch.float32, seed=3)
    doc_ids = torch.tensor([[0] * 10 + [1] * 25 + [2] * 5], dtype=torch.int32)
    out = packed_causal(q, k, v, doc_ids)
    s = (q @ k.transpose(-1, -2) / 4.0)[0, 0]
    for i in range(40):
        j0 = doc_ids[0].tolist().index(doc_ids[0, i].item())
        w = torch.softmax(s[i, j0 : i + 1], dim=-1)
        torch.testing.assert_close(out[0, 0, i], w @ v[0, 0, j0 : i + 1], atol=1e-5, rtol=1e-5)


def test_document_rows_before_the_keys_keep_nothing():
    """Nq > Nk: queries at negative positions belong to no document, so softmax gives them 0 (lse -inf)."""
    q, k, v = _inputs(1, 2, 1, 50, 30, 32, torch.float32, seed=4)
    doc_ids = _packed_doc_ids(1, 30, seed=5)
    out, lse = packed_bidirectional(q, k, v, doc_ids, return_lse=True)
    assert (out[:, :, :20] == 0).all() and torch.isneginf(lse[:, :, :20]).all()
    assert torch.isfinite(lse[:, :, 20:]).all()
    _check(packed_bidirectional, q, k, v, doc_ids, lse=True)


def test_document_rejects_bad_doc_ids():
    q, k, v = _inputs(1, 1, 1, 8, 8, 16, torch.float32, seed=0)
    with pytest.raises(InputError, match="doc_ids"):
        packed_causal(q, k, v, torch.zeros(1, 8))
    with pytest.raises(InputError, match="doc_ids"):
        packed_causal(q, k, v, torch.zeros(1, 9, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------
# (c) sigmoid_attention


def test_sigmoid_attention_conforms():
    check_combinator("_test_sigmoid_attention", max_examples=FUZZ_EXAMPLES)


@af.attention
def sigmoid_causal(q, k, v):
    return af._test_sigmoid_attention(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def sigmoid_biased_window(q, k, v):
    s = af.sliding_window(af.scaled_dot_product(q, k), 16)
    return af._test_sigmoid_attention(s, bias=-1.0) @ v


@pytest.mark.parametrize("program", [sigmoid_causal, sigmoid_biased_window], ids=["causal", "window_bias"])
@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_sigmoid_attention_fixed_program(program, device, dtype, shape):
    q, k, v = _inputs(*shape, dtype, seed=_seed("sigmoid", shape, dtype), device=device)
    _check(program, q, k, v)


def test_sigmoid_attention_has_no_lse():
    q, k, v = _inputs(1, 1, 1, 8, 8, 16, torch.float32, seed=0)
    with pytest.raises(InputError, match="lse"):
        sigmoid_causal(q, k, v, return_lse=True)


@pytest.mark.parametrize("bias", [math.inf, "x"])
def test_sigmoid_attention_rejects_bad_bias(bias):
    @af.attention
    def bad(q, k, v):
        return af._test_sigmoid_attention(af.scaled_dot_product(q, k), bias=bias) @ v

    with pytest.raises(af.ProgramError, match="bias"):
        bad.graph()


# ---------------------------------------------------------------------------------------------------------
# All three at once, in one kernel.


@af.attention
def everything(q, k, v, doc_ids):
    s = af.scaled_dot_product(*af._test_qk_norm(q, k), scale=6.0)
    s = af.causal(af._test_document(s, doc_ids))
    return af._test_sigmoid_attention(s, bias=-2.0) @ v


@pytest.mark.parametrize("device, dtype", CASES)
def test_all_three_roles_in_one_kernel(device, dtype):
    shape = (2, 2, 1, 45, 61, 32)
    q, k, v = _inputs(*shape, dtype, seed=_seed("everything", dtype), device=device)
    doc_ids = _packed_doc_ids(2, 61, seed=7).to(device)
    _check(everything, q, k, v, doc_ids)
    source = everything.source(q, k, v, doc_ids)
    assert source.count("def ") == 1  # one fused kernel
    for name in ("_test_qk_norm", "_test_document", "_test_sigmoid_attention"):
        assert name in source
