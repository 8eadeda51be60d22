"""rope's partial (``rotary_dim``) and interleaved (``interleaved``) rotations: GPT-NeoX's rotary_pct, GPT-J.

Forward and q/k/v gradients against the float64 reference evaluator, which is checked once against HF's
formulas written out here (NeoX's ``q[..., :rotary_dim]`` with ``rotate_half``, GPT-J's ``rotate_every_two``
with ``repeat_interleave(2)`` tables) and torch SDPA; with GQA, decoding from a cache with kv_lens (keys
rotated or not), chunk positions, theta and given tables, fused and hoisted into transform passes, after
qk_norm. Bad parameters and tables are refused; the default rotation's program is the one it was.
"""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse import ir
from attnfuse.cli import main
from attnfuse.combinator import Combinator, Param, QKTransformFragment, Role
from attnfuse.errors import DeclarationError
from attnfuse.runtime import hoisted
from attnfuse.testing import assert_matches_reference

from conftest import hoisted_last_call, plan_setting

# (rotary_dim, interleaved): GPT-J (partial, interleaved), GPT-NeoX (partial), Meta's Llama (interleaved),
# the narrowest partial, and a rotary_dim of all of D given explicitly.
VARIANTS = [(8, True), (8, False), (None, True), (2, False), (16, True)]
VARIANT_IDS = [f"rotary_dim={r}-{'interleaved' if i else 'halves'}" for r, i in VARIANTS]


def _program(rotary_dim, interleaved, tables=False, rotate_keys=True, normed=False):
    """A causal softmax program of rope with these parameters (theta 500, or cos/sin tables), after qk_norm."""

    def rope(q, k, **tables_given):
        return af.rope(
            q, k, rotary_dim=rotary_dim, interleaved=interleaved, rotate_keys=rotate_keys, theta=500.0, **tables_given
        )

    if normed:

        def program(q, k, v, wq, wk, cos, sin):
            q, k = af.qk_norm(q, k, wq, wk)
            return af.softmax(af.causal(rope(q, k, cos=cos, sin=sin))) @ v

    elif tables:

        def program(q, k, v, cos, sin):
            return af.softmax(af.causal(rope(q, k, cos=cos, sin=sin))) @ v

    else:

        def program(q, k, v):
            return af.softmax(af.causal(rope(q, k))) @ v

    return af.attention(program)


def _qkv(B, Hq, Hkv, Nq, Nk, D, grad=False, dtype=torch.float32):
    q, k, v = torch.randn(B, Hq, Nq, D), torch.randn(B, Hkv, Nk, D), torch.randn(B, Hkv, Nk, D)
    return tuple(t.to(dtype).requires_grad_(grad) for t in (q, k, v))


def _tables(rows: int, R: int, interleaved: bool, batch: int | None = None):
    """cos, sin (rows, R) or (batch, rows, R) of random angles, a pair's two columns sharing theirs, laid
    out as HF does: cat(freqs, freqs), or each frequency twice (interleaved)."""
    angles = torch.randn(*(() if batch is None else (batch,)), rows, R // 2) * 3
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _check_forward(program, q, k, v, *extra, **call):
    got = program(q, k, v, *extra, **call)
    ref64 = program.reference(q, k, v, *extra, **call)
    assert_matches_reference(got, ref64, program.reference(q, k, v, *extra, dtype=q.dtype, **call))
    return got


def _check_grads(program, q, k, v, *extra, **call):
    out = program(q, k, v, *extra, **call)
    dout = torch.randn(out.shape).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want64 = torch.autograd.grad(program.reference(q, k, v, *extra, **call), (q, k, v), dout.double())
    want_lowp = torch.autograd.grad(program.reference(q, k, v, *extra, dtype=q.dtype, **call), (q, k, v), dout)
    ref64 = program.reference(q, k, v, *extra, **call)
    assert_matches_reference(out, ref64, program.reference(q, k, v, *extra, dtype=q.dtype, **call))
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want64, want_lowp):
        assert_matches_reference(a, b, c, q.dtype, what=name)


# The reference, against HF's formulas written out independently.


def _hf_rotate(x, cos, sin, rotary_dim, interleaved):
    """HF's rotation of x (B, H, N, D) by cos, sin (N, R): GPT-J's (rotate_every_two) or GPT-NeoX's
    (rotate_half), on the first R columns, the rest passed through."""
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
        turned = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        turned = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + turned * sin, x_pass), dim=-1)


@pytest.mark.parametrize("rotary_dim, interleaved", [(8, True), (8, False), (32, True), (4, False)])
def test_matches_hf_formulas_and_sdpa(rotary_dim, interleaved):
    """Independent of the reference evaluator: HF's tables from theta, HF's rotation, then torch SDPA."""
    q, k, v = _qkv(2, 2, 2, 24, 24, 32)
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.arange(24, dtype=torch.float64)[:, None] * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    qr, kr = (_hf_rotate(x.double(), cos, sin, rotary_dim, interleaved) for x in (q, k))
    want = torch.nn.functional.scaled_dot_product_attention(qr, kr, v.double(), is_causal=True)
    for program, extra in (
        (_program(rotary_dim, interleaved), ()),
        (_program(rotary_dim, interleaved, tables=True), (cos.float(), sin.float())),
    ):
        torch.testing.assert_close(program.reference(q, k, v, *extra), want)
        torch.testing.assert_close(program(q, k, v, *extra), want.float(), atol=2e-5, rtol=2e-5)


# The kernels against the reference.

# B, Hq, Hkv, Nq, Nk, D: GQA off the interpreter's 32-row tiles; MHA; MQA with D=32.
SHAPES = [(2, 4, 2, 20, 37, 16), (1, 2, 2, 33, 33, 16), (1, 4, 1, 12, 45, 32)]


@pytest.mark.parametrize("tables", [False, True], ids=["theta", "tables"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*s))
@pytest.mark.parametrize("rotary_dim, interleaved", VARIANTS, ids=VARIANT_IDS)
def test_forward_and_gradients_match_reference(rotary_dim, interleaved, shape, tables):
    q, k, v = _qkv(*shape, grad=True)
    R = rotary_dim or shape[-1]
    extra = _tables(shape[4], R, interleaved, batch=shape[0]) if tables else ()
    _check_grads(_program(rotary_dim, interleaved, tables), q, k, v, *extra)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_forward_in_other_dtypes(dtype):
    q, k, v = _qkv(1, 2, 1, 24, 40, 16, dtype=dtype)
    _check_forward(_program(8, True), q, k, v)


def test_padded_halves():
    """D=24: each half (12 columns) padded to a 16-wide tile; the pass-through columns cross the padding."""
    q, k, v = _qkv(1, 2, 1, 20, 30, 24, grad=True)
    for rotary_dim, interleaved in ((8, True), (10, False), (None, True)):
        _check_grads(_program(rotary_dim, interleaved), q, k, v)


@pytest.mark.parametrize("rotate_keys", [True, False])
@pytest.mark.parametrize("rotary_dim, interleaved", [(8, True), (8, False)])
def test_decoding_with_kv_lens(rotary_dim, interleaved, rotate_keys):
    """A few queries against a cache with per-sequence lengths (the split-KV decoding kernel); with
    rotate_keys=False the cache holds keys rotated already."""
    q, k, v = _qkv(3, 4, 2, 2, 48, 16)
    kv_lens = torch.tensor([48, 17, 2], dtype=torch.int32)
    _check_forward(_program(rotary_dim, interleaved, rotate_keys=rotate_keys), q, k, v, kv_lens=kv_lens)


@pytest.mark.parametrize("tables", [False, True], ids=["theta", "tables"])
def test_chunk_positions(tables):
    """A chunk placed by q_offset/k_offset: the rotation reads its rows' positions."""
    q, k, v = _qkv(1, 2, 1, 12, 20, 16, grad=True)
    extra = _tables(64, 8, True) if tables else ()
    _check_grads(_program(8, True, tables), q, k, v, *extra, q_offset=30, k_offset=22, seq_len=64)


@pytest.mark.parametrize("rotary_dim, interleaved", [(8, True), (8, False), (None, True)])
def test_after_qk_norm(rotary_dim, interleaved):
    """qk_norm before the rotation reads its weights at the columns the rotation lays its halves out by."""
    q, k, v = _qkv(2, 4, 2, 30, 40, 16, grad=True)
    wq, wk = torch.rand(16) * 2 - 0.5, torch.rand(16) * 2 - 0.5
    cos, sin = _tables(40, rotary_dim or 16, interleaved)
    _check_grads(_program(rotary_dim, interleaved, normed=True), q, k, v, wq, wk, cos, sin)


@pytest.mark.parametrize("rotary_dim, interleaved", [(8, True), (8, False), (None, True)])
def test_hoisted_and_fused_agree_with_reference(rotary_dim, interleaved):
    """Hoisted into transform passes (and a gradient pass) or run inside the kernels: both match."""
    q, k, v = _qkv(1, 4, 2, 64, 70, 16, grad=True)
    wq, wk = torch.rand(16) * 2 - 0.5, torch.rand(16) * 2 - 0.5
    cos, sin = _tables(70, rotary_dim or 16, interleaved)
    program = _program(rotary_dim, interleaved, normed=True)
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 1):
        _check_grads(program, q, k, v, wq, wk, cos, sin)
        assert hoisted_last_call()
        hoisted_out = program(q, k, v, wq, wk, cos, sin)
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 10**9):
        _check_grads(program, q, k, v, wq, wk, cos, sin)
        assert not hoisted_last_call()
        torch.testing.assert_close(program(q, k, v, wq, wk, cos, sin), hoisted_out)


# The default rotation's program, and what the kernels show.


def test_default_parameters_leave_the_program_as_it_was():
    """rotary_dim=None and interleaved=False, given or not, are left out of the IR: the signature, and so
    every generated kernel, is the one of rope before these parameters existed."""

    def program(**params):
        return af.attention(lambda q, k, v: af.softmax(af.causal(af.rope(q, k, **params))) @ v)

    plain = program()
    listing = ir.render(plain.graph())
    assert "rope(" in listing and "rotary_dim" not in listing and "interleaved" not in listing
    assert ir.signature(program(rotary_dim=None, interleaved=False).graph()) == ir.signature(plain.graph())
    assert ir.signature(program(rotary_dim=8).graph()) != ir.signature(plain.graph())
    assert ir.signature(program(interleaved=True).graph()) != ir.signature(plain.graph())
    assert "rotary_dim=8, interleaved=True)" in ir.render(program(rotary_dim=8, interleaved=True).graph())


def test_kernels_load_by_the_column_map():
    q, k, v = _qkv(1, 2, 1, 8, 8, 16)
    forward = _program(8, True).source(q, k, v)
    assert "tl.where(dh < 4, 2 * dh, dh + 4)" in forward and "dh + HALF * stride" not in forward
    assert "tl.where(dh < 4, 2 * dh, dh + 4)" not in _program(None, True).source(q, k, v)


@af.attention
def gptj(q, k, v, rotary_dim=8, interleaved=True):
    """GPT-J's attention: interleaved pairs of the first rotary_dim columns, causal softmax."""
    return af.softmax(af.causal(af.rope(q, k, rotary_dim=rotary_dim, interleaved=interleaved))) @ v


@pytest.mark.parametrize("kernel", ["forward", "transform"])
def test_show_prints_the_parameters_and_the_kernel_a_call_runs(capsys, kernel):
    code = main(
        [
            "show",
            f"{__name__}:gptj",
            "--arch",
            "interpreter",
            "--head-dim",
            "32",
            "--arg",
            "rotary_dim=12",
            "--kernel",
            kernel,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert (
        "rope(theta=10000.0, scale=None, cos=None, sin=None, rotate_keys=True, rotary_dim=12, interleaved=True)" in out
    )
    q, k, v = _qkv(1, 1, 1, 8, 8, 32)
    want = gptj.source(q, k, v, rotary_dim=12, kernel=kernel)
    assert out.split("# source\n", 1)[1] == want + ("" if want.endswith("\n") else "\n")


# Bad parameters and tables.


@pytest.mark.parametrize("value", [7, 0, -2, 8.0, "8", True], ids=repr)
def test_bad_rotary_dim_is_refused(value):
    with pytest.raises(af.ProgramError, match=r"rope: parameter 'rotary_dim': must be None .* an even int > 0"):
        _program(value, False)(*_qkv(1, 1, 1, 8, 8, 16))


def test_rotary_dim_above_the_head_dim_is_refused():
    program = _program(18, True)
    for call in (program, program.reference):
        with pytest.raises(af.InputError, match=r"rope: rotary_dim=18 must be at most the head dim D=16"):
            call(*_qkv(1, 1, 1, 8, 8, 16))


@pytest.mark.parametrize("value", [1, 0, "yes", None], ids=repr)
def test_bad_interleaved_is_refused(value):
    with pytest.raises(af.ProgramError, match=r"rope: parameter 'interleaved': must be True or False"):
        _program(None, value)(*_qkv(1, 1, 1, 8, 8, 16))


@pytest.mark.parametrize(
    "rotary_dim, interleaved, width, match",
    [
        (8, True, 4, r"cos must have shape \(Nk, rotary_dim\) .* got \(20, 4\); interleaved tables .* 8 wide, not 4"),
        (8, False, 16, r"cos must have shape \(Nk, rotary_dim\) or \(B, Nk, rotary_dim\) = \(20, 8\)"),
        (None, True, 8, r"cos must have shape \(Nk, D\) .* = \(20, 16\) .* 16 wide, not 8"),
    ],
)
@pytest.mark.parametrize("run", ["call", "reference"])
def test_tables_of_the_wrong_width_are_refused(rotary_dim, interleaved, width, match, run):
    program = _program(rotary_dim, interleaved, tables=True)
    call = program if run == "call" else program.reference
    cos, sin = torch.randn(20, width), torch.randn(20, width)
    with pytest.raises(af.InputError, match=f"rope: {match}"):
        call(*_qkv(1, 1, 1, 8, 20, 16), cos, sin)


# The column map, as a plugin declares it.


def _shuffle(columns):
    """A qk transform that does nothing but declare a column map."""
    return Combinator(
        name=f"_test_columns_{abs(hash(columns)) % 10**6}",
        role=Role.QK_TRANSFORM,
        doc="declares a column map",
        params=[],
        reference=lambda q, k, ctx: (q, k),
        fragment=QKTransformFragment(q="$x1 = $x1 * 1.0\n", q_grad="", columns=columns),
    )


def test_two_column_maps_are_refused():
    reversed_halves = _shuffle(("dh + HALF", "dh"))
    af.register_plugin(_Plugin(reversed_halves), name="test-rope-variants:columns")
    try:
        name = reversed_halves.name

        @af.attention
        def program(q, k, v):
            q, k = getattr(af, name)(q, k)
            return af.softmax(af.rope(q, k, interleaved=True)) @ v

        with pytest.raises(af.ProgramError, match=rf"{name}\(\) and rope\(.*interleaved=True\) lay q's and k's"):
            program(*_qkv(1, 1, 1, 8, 8, 16))
    finally:
        af.unregister_plugin("test-rope-variants:columns")


def test_a_transform_reading_columns_by_dh_is_refused_with_a_column_map():
    """A transform that loads per-column data at dh (not $col1/$col2) would read the wrong columns."""
    scaled = Combinator(
        name="_test_dh_scale",
        role=Role.QK_TRANSFORM,
        doc="scales each column by (1 + its index / 100)",
        params=[],
        reference=lambda q, k, ctx: (q, k),
        fragment=QKTransformFragment(q="$x1 = $x1 * (1.0 + dh[None, :] / 100.0)\n", q_grad=""),
    )
    af.register_plugin(_Plugin(scaled), name="test-rope-variants:dh")
    try:

        @af.attention
        def program(q, k, v):
            q, k = af._test_dh_scale(q, k)
            return af.softmax(af.rope(q, k, rotary_dim=8)) @ v

        with pytest.raises(af.ProgramError, match=r"_test_dh_scale\(\) reads head-dim columns by dh, but rope\("):
            program(*_qkv(1, 1, 1, 8, 8, 16))
    finally:
        af.unregister_plugin("test-rope-variants:dh")


class _Plugin:
    def __init__(self, combinator: Combinator):
        self.combinator = combinator

    @af.hookimpl
    def attnfuse_combinators(self):
        return [self.combinator]


@pytest.mark.parametrize("columns", [("dh",), "dh", ("dh", 3), ("dh", " ")], ids=repr)
def test_a_bad_column_map_declaration_is_refused(columns):
    with pytest.raises(DeclarationError, match="columns must be None or a pair of expression strings of dh"):
        QKTransformFragment(q="", columns=columns)


def test_recorded_at_default_needs_a_static_default():
    for kwargs in ({"runtime": True, "default": None}, {}):
        with pytest.raises(DeclarationError, match="recorded_at_default=False needs a static parameter"):
            Param(name="p", recorded_at_default=False, **kwargs)
