"""Static parameter values reach generated source only as literals that cannot be code.

A third-party combinator registered in code, ``_test_scaled(s, factor=2.0, mode="plain")``, takes two
static parameters with no check of their own: ``factor`` is written into its fragment (``s * $factor``),
``mode`` picks the fragment. Values that could be code (a string closing the header's docstring, a float
subclass with its own ``repr``), non-finite floats, floats Triton would type as float64 and ints past
int64 are refused at trace time with a ProgramError naming the combinator and the parameter; the
built-ins' number parameters likewise.
"""

from __future__ import annotations

import ast
import decimal
import fractions
import math
import re

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnfuse as af
from attnfuse import ir
from attnfuse.combinator import REQUIRED, Combinator, Param, Role, ScoreModFragment
from attnfuse.errors import ProgramError
from attnfuse.passes.codegen.common import docstring_text
from attnfuse.static_values import exact, literal
from attnfuse.testing import assert_matches_reference
from attnfuse.testing.strategies import Shape


def scaled_reference(s, ctx, factor, mode):
    """s (B, Hq, Nq, Nk) -> s·factor, negated when mode is "neg"."""
    return -(s * factor) if mode == "neg" else s * factor


def scaled_fragment(factor, mode):
    if mode == "neg":
        return ScoreModFragment(body="s = -(s * $factor)", grad="ds = -(ds * $factor)")
    return ScoreModFragment(body="s = s * $factor", grad="ds = ds * $factor")


SCALED = Combinator(
    name="_test_scaled",
    role=Role.SCORE_MOD,
    doc="s <- s·factor, or -(s·factor) for mode 'neg'; neither parameter has a check.",
    params=[Param(name="factor", default=2.0, doc="a multiplier"), Param(name="mode", default="plain")],
    reference=scaled_reference,
    fragment=scaled_fragment,
)


def typed_factor(x) -> float:
    """What ``_test_typed``'s x means by its type: a flag negates (True) or keeps (False), an int n scales by
    n + 1, a float by itself, and a zero float by ±0.5 after its sign (so True, 1, 1.0 and 0, False, 0.0,
    -0.0, all equal in Python, each mean something else)."""
    if isinstance(x, bool):
        return -1.0 if x else 1.0
    if isinstance(x, int):
        return float(x + 1)
    return x if x != 0 else math.copysign(0.5, x)


def typed_fragment(x):
    factor = float.__repr__(typed_factor(x))
    return ScoreModFragment(body=f"s = s * {factor}", grad=f"ds = ds * {factor}")


TYPED = Combinator(
    name="_test_typed",
    role=Role.SCORE_MOD,
    doc="s <- s·f(x), where f reads x's type as well as its value (typed_factor).",
    params=[Param(name="x", default=1.0, doc="a flag, an int or a float")],
    reference=lambda s, ctx, x: s * typed_factor(x),
    fragment=typed_fragment,
)


class _Plugin:
    @af.hookimpl
    def attnfuse_combinators(self):
        return [SCALED, TYPED]


@pytest.fixture(scope="module", autouse=True)
def scaled_plugin():
    af.register_plugin(_Plugin(), name="static-values-test")
    try:
        yield
    finally:
        af.unregister_plugin("static-values-test")


@af.attention
def scaled(q, k, v, factor, mode):
    return af.softmax(af._test_scaled(af.scaled_dot_product(q, k), factor, mode)) @ v


@af.attention
def typed(q, k, v, x):
    return af.softmax(af._test_typed(af.scaled_dot_product(q, k), x)) @ v


def _qkv(dtype=torch.float32):
    return tuple(torch.randn(1, 2, 16, 16, dtype=dtype) for _ in range(3))


def _every_use(program, *extra):
    """Trace, source, reference and call: each raises the same ProgramError when a static value is refused."""
    q, k, v = _qkv()
    yield lambda: program.graph(*extra)
    yield lambda: program.source(q, k, v, *extra)
    yield lambda: program.reference(q, k, v, *extra)
    yield lambda: program(q, k, v, *extra)


def _payload(marker) -> str:
    return f'x"""; import pathlib; pathlib.Path("{marker}").write_text("ran"); """'


def test_a_string_closing_the_header_docstring_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    for use in _every_use(scaled, 2.0, _payload(marker)):
        with pytest.raises(ProgramError, match=r"_test_scaled: parameter 'mode': a str must be an identifier-like"):
            use()
    assert not marker.exists()


def test_a_float_subclass_counts_by_its_value_and_its_repr_never_runs(tmp_path):
    """An int/float/str subclass (numpy.float64, an IntEnum) is converted to the plain value it holds."""
    marker = tmp_path / "ran"

    class Sneaky(float):
        def __repr__(self):
            return f'(__import__("pathlib").Path("{marker}").write_text("ran") and 2.0)'

    q, k, v = _qkv()
    got = scaled(q, k, v, Sneaky(0.5), "plain")
    assert_matches_reference(
        got, scaled.reference(q, k, v, 0.5, "plain"), scaled.reference(q, k, v, 0.5, "plain", dtype=q.dtype), q.dtype
    )
    source = scaled.source(q, k, v, Sneaky(0.5), "plain")
    assert "factor=0.5, mode='plain'" in source and "__import__" not in source
    assert not marker.exists()


@pytest.mark.parametrize("mode", ["", "neox rope", "2x", "x" * 65, "café", "neox\n", "a'b", 'a"b', "a\\b"])
def test_strings_outside_the_whitelist_are_refused(mode):
    with pytest.raises(ProgramError, match=r"_test_scaled: parameter 'mode': a str must be an identifier-like"):
        scaled.graph(2.0, mode)


@pytest.mark.parametrize(
    "factor, shown",
    [
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (math.nan, "nan"),
        (1e39, "1e+39"),
        (-1e300, "-1e+300"),
        (1e-39, "1e-39"),
        (2**63, "9223372036854775808"),
        (-(2**63) - 1, "-9223372036854775809"),
        (10**400, "an int of 1329 bits"),
    ],
)
def test_numbers_no_kernel_literal_holds_are_refused(factor, shown):
    """Non-finite floats (inf and nan would be bare names in the source), floats Triton would type as
    float64, and ints past int64."""
    for use in _every_use(scaled, factor, "plain"):
        with pytest.raises(ProgramError, match=rf"_test_scaled: parameter 'factor': .* got {re.escape(shown)}$"):
            use()


def test_nested_values_are_refused():
    with pytest.raises(
        ProgramError,
        match=r"_test_scaled: parameter 'factor' must be None, bool, int, float or "
        r"str, got tuple",
    ):
        scaled.graph((1.0, 2.0), "plain")


@pytest.mark.parametrize(
    "factor, mode",
    [(0.5, "neg"), (-1.5, "plain"), (3, "neg"), (2**62, "plain"), (0.0, "plain"), (1e-30, "neg"), (1e30, "plain")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_valid_values_work_and_match_the_reference(factor, mode, dtype):
    q, k, v = _qkv(dtype)
    got = scaled(q, k, v, factor, mode)
    assert_matches_reference(
        got, scaled.reference(q, k, v, factor, mode), scaled.reference(q, k, v, factor, mode, dtype=dtype), dtype
    )
    assert f"factor={literal(factor)}, mode={mode!r}" in scaled.source(q, k, v, factor, mode)


_OUTSIDE = {"x": 1}


@af.attention
def reads_outside(q, k, v):
    return af.softmax(af._test_typed(af.scaled_dot_product(q, k), _OUTSIDE["x"])) @ v


def _typed_reference(q, k, v, x, dtype=torch.float64):
    """softmax(q·kᵀ/√D · typed_factor(x)) · v in ``dtype``, by torch alone: no trace a stale key could share."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 * typed_factor(x)
    return torch.softmax(s, dim=-1) @ v


def _unboxed(box):
    return box[0] if isinstance(box, (tuple, list)) else box


EQUAL_ACROSS_TYPES = {
    "one": [True, 1, 1.0, numpy.float64(1.0)],
    "zero": [False, 0, 0.0, -0.0, numpy.float64(-0.0)],
    "two": [2, 2.0],
}


@pytest.mark.parametrize("order", ["given", "reversed"])
@pytest.mark.parametrize("group", sorted(EQUAL_ACROSS_TYPES))
def test_values_equal_across_types_each_get_their_own_kernel(group, order):
    """Static values that compare equal (True == 1 == 1.0, 0 == False == 0.0 == -0.0) but mean different things
    to a combinator: each call, in any order, gets its own trace and kernel, and its own result."""
    values = EQUAL_ACROSS_TYPES[group][:: 1 if order == "given" else -1]
    q, k, v = _qkv()
    for x in values:
        got = typed(q, k, v, x)
        assert_matches_reference(got, _typed_reference(q, k, v, x), _typed_reference(q, k, v, x, q.dtype), q.dtype)
        assert f"_test_typed(x={literal(exact(x))})" in typed.source(q, k, v, x)


@pytest.mark.parametrize("group", sorted(EQUAL_ACROSS_TYPES))
def test_outside_values_equal_across_types_each_get_their_own_kernel(group):
    """The same through a value the program reads from outside (a closure), and a tuple element of one."""
    q, k, v = _qkv()
    for x in EQUAL_ACROSS_TYPES[group]:
        for box in (x, (x,), [x]):

            @af.attention
            def outside(q, k, v):
                return af.softmax(af._test_typed(af.scaled_dot_product(q, k), _unboxed(box))) @ v

            got = outside(q, k, v)
            assert_matches_reference(got, _typed_reference(q, k, v, x), _typed_reference(q, k, v, x, q.dtype), q.dtype)


def test_a_program_reading_a_changed_outside_value_of_an_equal_value_of_another_type_traces_again():
    """One program object, its global changing from 1 to True to 1.0 to -0.0 and 0.0: each value its own result."""
    q, k, v = _qkv()
    for x in (1, True, 1.0, 0.0, -0.0, False, 0):
        _OUTSIDE["x"] = x
        got = reads_outside(q, k, v)
        assert_matches_reference(got, _typed_reference(q, k, v, x), _typed_reference(q, k, v, x, q.dtype), q.dtype)


NOT_STATIC = {
    "numpy.int64": numpy.int64(1),
    "numpy.bool_": numpy.bool_(True),
    "numpy.float32": numpy.float32(0.5),
    "Fraction": fractions.Fraction(1, 2),
    "Decimal": decimal.Decimal("0.5"),
}


@pytest.mark.parametrize("x", list(NOT_STATIC.values()), ids=list(NOT_STATIC))
def test_numbers_of_other_types_are_refused_not_taken_as_their_equal(x):
    """Number types that are no bool, int or float subclass: a clear error as an argument and as a read from
    outside, never the kernel of an equal value."""
    q, k, v = _qkv()
    name = type(x).__name__
    with pytest.raises(af.InputError, match=rf"argument 'x' must be a tensor, a BlockMask, or a static .*got {name}"):
        typed(q, k, v, x)

    @af.attention
    def outside(q, k, v):
        return af.softmax(af._test_typed(af.scaled_dot_product(q, k), x)) @ v

    with pytest.raises(ProgramError, match=rf"reads the closure variable 'x', which holds a {name}"):
        outside(q, k, v)


def test_graphs_with_values_equal_across_types_are_not_equal():
    graphs = [typed.graph(x) for group in EQUAL_ACROSS_TYPES.values() for x in group]
    distinct = {(type(exact(x)), literal(exact(x))) for group in EQUAL_ACROSS_TYPES.values() for x in group}
    assert len(set(graphs)) == len(distinct)
    assert len({ir.signature(g) for g in graphs}) == len(distinct)


def test_the_header_docstring_is_exactly_the_listing():
    q, k, v = _qkv()
    source = scaled.source(q, k, v, 0.5, "neg")
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    assert docstring.endswith("\n" + ir.render(scaled.graph(0.5, "neg")) + "\n")


@settings(max_examples=200, deadline=None, database=None)
@given(st.text())
def test_docstring_text_cannot_end_the_docstring(text):
    """Whatever a listing holds, the docstring the header writes reads back as exactly it."""
    module = ast.parse('"""' + docstring_text(text) + '"""\nx = 1\n')
    assert len(module.body) == 2 and ast.get_docstring(module, clean=False) == text


def test_an_apply_built_directly_checks_its_values():
    with pytest.raises(ProgramError, match=r"_test_scaled: parameter 'factor': a float must be 0 or"):
        ir.Apply(
            combinator="_test_scaled",
            params=(("factor", math.nan), ("mode", "plain")),
            record=af.combinators()["_test_scaled"],
        )


# Built-in and contrib combinators: every static number parameter, with values no kernel takes.


def _sdp(s_value):
    return lambda q, k, v: af.softmax(af.scaled_dot_product(q, k, scale=s_value)) @ v


BUILTIN_PARAMETERS = {
    ("scaled_dot_product", "scale"): lambda x: lambda q, k, v: af.softmax(af.scaled_dot_product(q, k, scale=x)) @ v,
    ("rope", "theta"): lambda x: lambda q, k, v: af.softmax(af.rope(q, k, theta=x)) @ v,
    ("rope", "scale"): lambda x: lambda q, k, v: af.softmax(af.rope(q, k, scale=x)) @ v,
    ("rope", "rotate_keys"): lambda x: lambda q, k, v: af.softmax(af.rope(q, k, rotate_keys=x)) @ v,
    ("sliding_window", "left"): lambda x: (
        lambda q, k, v: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), x)) @ v
    ),
    ("sliding_window", "right"): lambda x: (
        lambda q, k, v: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 1, x)) @ v
    ),
    ("softcap", "cap"): lambda x: lambda q, k, v: af.softmax(af.softcap(af.scaled_dot_product(q, k), x)) @ v,
    ("sigmoid_attention", "bias"): lambda x: lambda q, k, v: af.sigmoid_attention(af.scaled_dot_product(q, k), x) @ v,
    ("alibi", "slopes"): lambda x: lambda q, k, v: af.softmax(af.alibi(af.scaled_dot_product(q, k), x)) @ v,
    ("softmax_with_sinks", "sinks"): lambda x: (
        lambda q, k, v: af.softmax_with_sinks(af.scaled_dot_product(q, k), x) @ v
    ),
}
BAD_NUMBERS = {
    "10**400": 10**400,
    "-10**400": -(10**400),
    "2**70": 2**70,
    "2**63": 2**63,
    "inf": math.inf,
    "-inf": -math.inf,
    "nan": math.nan,
    "1e39": 1e39,
    "1e-300": 1e-300,
    "True": True,
}


@pytest.mark.parametrize("value", list(BAD_NUMBERS.values()), ids=list(BAD_NUMBERS))
@pytest.mark.parametrize(
    "combinator, parameter", sorted(BUILTIN_PARAMETERS), ids=[f"{c}.{p}" for c, p in sorted(BUILTIN_PARAMETERS)]
)
def test_builtin_number_parameters_refuse_what_no_kernel_takes(combinator, parameter, value):
    """A ProgramError naming the combinator and parameter, never a bare OverflowError; True is no number
    (rotate_keys is the flag that takes it)."""
    program = af.attention(BUILTIN_PARAMETERS[combinator, parameter](value))
    if parameter == "rotate_keys" and value is True:
        program.graph()
        return
    q, k, v = _qkv()
    for use in (program.graph, lambda: program.reference(q, k, v), lambda: program(q, k, v)):
        with pytest.raises(ProgramError, match=rf"^{combinator}: parameter '{parameter}'"):
            use()


@pytest.mark.parametrize("scale", [3e38, -3e38])
def test_a_scale_whose_product_with_the_score_factor_no_literal_holds_is_refused(scale):
    """softmax works in log2 units: the kernel writes scale·log2(e), past float32's range here."""
    q, k, v = _qkv()
    with pytest.raises(
        ProgramError,
        match=r"scaled_dot_product: parameter 'scale' \(times 1\.44.*, the score "
        r"factor of softmax\): a float must be 0 or",
    ):
        af.attention(_sdp(scale))(q, k, v)


@pytest.mark.parametrize("left, right", [(2**63 - 1, 0), (0, 2**63 - 1), (2**63 - 1, 2**63 - 1), (3, 2**40)])
def test_the_widest_int64_windows_match_the_reference(left, right):
    """The reference computes q' + right in int64 too: it must not overflow."""

    @af.attention
    def window(q, k, v):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left, right)) @ v

    q, k, v = _qkv()
    assert_matches_reference(window(q, k, v), window.reference(q, k, v), window.reference(q, k, v, dtype=q.dtype))


@pytest.mark.parametrize("name", sorted(n for n in af.combinators() if not n.startswith("_test")))
def test_documented_parameter_values_have_literals(name):
    """Every registered combinator's defaults and the values its examples draw (the documented ones)."""
    comb = af.combinators()[name].combinator
    static = [p for p in comb.params if not p.runtime]
    for p in static:
        if p.default is not REQUIRED:
            literal(p.default)
    if comb.examples is None:
        return

    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data):
        params = comb.examples(data.draw, Shape(B=2, Hq=4, Hkv=2, Nq=16, Nk=24, D=16, DV=16))
        for p in static:
            if p.name in params:
                literal(params[p.name])

    draw()
