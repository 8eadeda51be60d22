"""The plugin contract of 2026-11-30 keeps working with a DeprecationWarning (see CHANGELOG.md): fragments that
spell the accumulation type tl.float32, required parameters without examples, and the fragment lookup
``attnfuse.passes.lower.fragment_of`` that docs/writing-a-combinator.md named until 2026-12-03. Plugins registered from
code here; tests/legacy_plugin/attnfuse-legacy-demo checks an installed package of such plugins."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnfuse as af
from attnfuse.combinator import Combinator, MaskFragment, Param, Role, ScoreModFragment, TensorArg
from attnfuse.errors import PluginError
from attnfuse.testing import assert_matches_reference, check_combinator, random_tensor


def registered(comb: Combinator, name: str):
    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [comb]

    af.register_plugin(Plugin(), name=name)
    return name


OLD_BIAS = Combinator(
    name="_test_old_row_bias",
    role=Role.SCORE_MOD,
    doc="s + b_h (old spelling)",
    params=[Param(name="bias", runtime=True, doc="(Hq,) float tensor")],
    reference=lambda s, ctx, bias: s + bias.to(s.dtype).view(1, -1, 1, 1),
    tensors=[TensorArg(name="bias", rank=1)],
    prepare=lambda ctx, bias: {"bias": bias},
    fragment=ScoreModFragment(
        prologue="${self}_b = tl.load($bias + h * $bias_s0).to(tl.float32)", body="s = s + ${self}_b", grad=""
    ),
    examples=lambda draw, shape: {"bias": random_tensor(draw, shape.Hq)},
)


@pytest.fixture(scope="module")
def old_bias():
    with pytest.warns(
        DeprecationWarning,
        match=r"combinator '_test_old_row_bias' of distribution '<registered in "
        r"code: test-old-bias>', fragment field 'prologue': spells the "
        r"accumulation type tl\.float32, .*write \$acc_dtype instead",
    ):
        name = registered(OLD_BIAS, "test-old-bias")
    yield
    af.unregister_plugin(name)


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.causal(af._test_old_row_bias(af.scaled_dot_product(q, k), bias))) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_old_spelling_computes_as_before(old_bias, dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g).to(dtype) for n in (19, 27, 27))
    bias = torch.randn(2, generator=g)
    out = biased(q, k, v, bias)
    assert_matches_reference(
        out, biased.reference(q, k, v, bias, dtype=torch.float64), biased.reference(q, k, v, bias, dtype=dtype), dtype
    )


def test_old_spelling_refuses_float64(old_bias):
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64) for _ in range(3))
    with pytest.raises(
        af.InputError,
        match=r"combinator '_test_old_row_bias' of distribution '<registered in code: "
        r"test-old-bias>', fragment field 'prologue': spells the accumulation "
        r"type tl\.float32 .*it would compute in float32 for these float64 "
        r"inputs; call it with float32, float16 or bfloat16 inputs",
    ):
        biased(q, k, v, torch.randn(2, dtype=torch.float64))


def width_mask(name: str) -> Combinator:
    return Combinator(
        name=name,
        role=Role.MASK,
        doc="keys within `width` before the query",
        params=[Param(name="width", doc="an int >= 1")],
        reference=lambda ctx, width: (ctx.k_pos <= ctx.q_pos) & (ctx.k_pos > ctx.q_pos - width),
        fragment=MaskFragment(keep="(k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - $width)"),
    )


def test_required_parameter_without_examples_warns_once_and_works():
    with pytest.warns(
        DeprecationWarning,
        match=r"combinator '_test_old_width': parameters \['width'\] have no "
        r"default and it declares no examples, .*declare "
        r"examples\(draw, shape\)",
    ):
        comb = width_mask("_test_old_width")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        width_mask("_test_old_width")  # once per combinator
    name = registered(comb, "test-old-width")
    try:
        program = af.attention(lambda q, k, v: af.softmax(af._test_old_width(af.scaled_dot_product(q, k), 5)) @ v)
        q, k, v = (torch.randn(1, 2, 21, 16) for _ in range(3))
        assert_matches_reference(
            program(q, k, v),
            program.reference(q, k, v, dtype=torch.float64),
            program.reference(q, k, v, dtype=torch.float32),
            torch.float32,
        )
        with pytest.raises(
            PluginError,
            match=r"check_combinator: combinator '_test_old_width' declares no "
            r"examples\(draw, shape\), so the kit cannot draw its parameters "
            r"\['width'\]",
        ):
            check_combinator("_test_old_width")
    finally:
        af.unregister_plugin(name)


def test_fragment_of_warns_and_gives_the_applications_fragment():
    from attnfuse.passes.lower import fragment_of

    @af.attention
    def windowed(q, k, v):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 3)) @ v

    graph = windowed.graph()
    for app in (graph.weights.apply, graph.weights.input.apply):  # softmax, sliding_window
        with pytest.warns(
            DeprecationWarning,
            match=r"fragment_of\(app\) is deprecated since 2026-12-03 .* call "
            r"app.fragment\(\)",
        ):
            old = fragment_of(app)
        assert old == app.fragment()
