"""The fragment contract: fragments are linted at registration (attnfuse.fragment_lint), and the template
names the linter protects are every name the generated kernels define."""

from __future__ import annotations

import ast
import re
import warnings

import pytest
import torch

import attnfuse as af
from attnfuse import examples
from attnfuse.combinator import (
    Combinator,
    MaskFragment,
    NormaliserFragment,
    Param,
    QKTransformFragment,
    Role,
    ScoreModFragment,
)
from attnfuse.errors import InputError, PluginError
from attnfuse.fragment_lint import TEMPLATE_NAMES, _TEMPLATE_PATTERN, lint, refuse_old_accumulator

MOD_REF = lambda s, ctx: s  # noqa: E731


def mod(body: str, **fields) -> Combinator:
    return Combinator(
        name="_test_lint",
        role=Role.SCORE_MOD,
        doc="test",
        reference=MOD_REF,
        fragment=ScoreModFragment(body=body, **fields),
    )


def norm(**fields) -> Combinator:
    base = dict(init="", update="p = s", finalize="out = acc")
    return Combinator(
        name="_test_lint",
        role=Role.NORMALISER,
        doc="test",
        reference=lambda s, keep, ctx: (s, None),
        fragment=NormaliserFragment(**{**base, **fields}),
    )


def mask(**fields) -> Combinator:
    return Combinator(
        name="_test_lint",
        role=Role.MASK,
        doc="test",
        reference=lambda ctx: None,
        fragment=MaskFragment(**{"keep": None, **fields}),
    )


def refused(comb: Combinator, field: str, says: str, line: str | None = None) -> None:
    with pytest.raises(
        PluginError,
        match=rf"combinator '_test_lint' of distribution 'dist-x', fragment field "
        rf"'{re.escape(field)}': {says}",
    ) as info:
        lint(comb, comb.fragment, "dist-x")
    if line is not None:
        assert f"> {line}" in str(info.value)


@pytest.mark.parametrize(
    "body, says, line",
    [
        (
            "k_pos = k_pos + 1\ns = s",
            r"writes 'k_pos', which the kernel template owns \(this slot may write 's'\)",
            "  1 | k_pos = k_pos + 1",
        ),
        ("acc = acc * 0\ns = s", "writes 'acc', which the kernel template owns", None),
        (
            "scaled = s * 2.0\ns = scaled",
            r"writes 'scaled': name temporaries \$\{self\}_<name>",
            "  1 | scaled = s * 2.0",
        ),
        ("s = s + tl.load(q_base)", "reads 'q_base', which this slot does not provide", None),
        ("s = s - m_i[:, None]", "reads 'm_i', which this slot does not provide", None),
        ("s = s +* 2", "syntax error: invalid syntax", "  1 | s = s +* 2"),
        ("${self}_t = s * $missing\ns = ${self}_t", r"syntax error: unknown placeholder \$missing", None),
        ("${self}_t = s * 2.0", r"never writes 's', its output", None),
    ],
)
def test_score_modification_body_refused(body, says, line):
    refused(mod(body), "body", says, line)


def test_valid_fragments_pass():
    for comb in (
        mod(
            "${self}_t = s * 2.0\ns = ${self}_t + k_pos[None, :] * 0.0",
            prologue="${self}_c = h * 2",
            grad="ds = ds * 2.0",
        ),
        norm(
            init="running = tl.zeros([BLOCK_M], dtype=$acc_dtype)",
            update="p = s\nrunning = running + 1",
            finalize="out = acc / running[:, None]",
        ),
    ):
        lint(comb, comb.fragment, "dist-x")


def test_old_accumulator_spelling_deprecated():
    """tl.float32 where $acc_dtype belongs (the contract of 2026-11-30) is accepted with one DeprecationWarning
    per combinator; it still gets every other check, and a float64 call of it is refused."""
    old = norm(
        init="running = tl.zeros([BLOCK_M], dtype=tl.float32)", update="p = s.to(tl.float32)", finalize="out = acc"
    )
    with pytest.warns(
        DeprecationWarning,
        match=r"combinator '_test_lint' of distribution 'dist-old-lint', fragment "
        r"fields 'init', 'update': spells the accumulation type tl\.float32, "
        r".*write \$acc_dtype instead",
    ):
        lint(old, old.fragment, "dist-old-lint")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lint(old, old.fragment, "dist-old-lint")  # once per combinator
    refused(mod("${self}_w = s\nk_pos = ${self}_w.to(tl.float32)"), "body", "writes 'k_pos'", "  2 | ")
    refuse_old_accumulator(old, old.fragment, "dist-old-lint", "float32")
    with pytest.raises(
        InputError,
        match=r"combinator '_test_lint' of distribution 'dist-old-lint', fragment fields "
        r"'init', 'update': spells the accumulation type tl\.float32 .*so it would "
        r"compute in float32 for these float64 inputs",
    ):
        refuse_old_accumulator(old, old.fragment, "dist-old-lint", "float64")


def test_normaliser_slots():
    refused(norm(update="acc = acc * 2"), "update", r"never writes 'p', its output")
    refused(norm(finalize="out = acc\nk_pos = 0"), "finalize", r"writes 'k_pos', which the kernel template owns")
    refused(norm(grad="ds = p * (dp - delta[:, None])"), "grad", r"reads 'delta', which this slot does not provide")
    with_delta = norm(grad="ds = p * (dp - delta[:, None])", needs_delta=True)
    lint(with_delta, with_delta.fragment, "dist-x")
    refused(norm(has_lse=True), "finalize", r"never writes 'lse', its output")


def test_mask_expressions():
    refused(mask(keep="s > 0"), "keep", r"reads 's', which this slot does not provide")
    refused(
        mask(keep="k_pos[None, :] <= q_pos[:, None]", kv_range=("0", "k_pos + 1")),
        "kv_range[1]",
        r"reads 'k_pos', which this slot does not provide",
    )
    refused(
        mask(keep="k_pos[None, :] >= 0", q_range=("$q_lo", "Nk")),
        "q_range[0]",
        r"reads \$q_lo, which this slot does not provide",
    )
    causal_like = mask(keep="k_pos[None, :] <= q_pos[:, None]", kv_range=("0", "$q_hi + 1"))
    lint(causal_like, causal_like.fragment, "dist-x")


def test_transform_temporaries_use_tmp():
    comb = Combinator(
        name="_test_lint",
        role=Role.QK_TRANSFORM,
        doc="t",
        reference=lambda q, k, ctx: (q, k),
        fragment=QKTransformFragment(q="n = $x1 * 2\n$x1 = n"),
    )
    refused(comb, "q", r"writes 'n': name temporaries \$\{self\}_<name> or \$\{tmp\}_<name>")


def test_broken_fragment_refused_at_registration():
    bad = mod("k_pos = k_pos + 1\ns = s")

    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [bad]

    with pytest.raises(
        PluginError,
        match=r"combinator '_test_lint' of distribution '<registered in code: "
        r"test-lint>', fragment field 'body': writes 'k_pos'",
    ):
        af.register_plugin(Plugin(), name="test-lint")
    assert "_test_lint" not in af.combinators()


def test_parameter_named_like_a_tensor_stride_refused():
    with pytest.raises(PluginError, match=r"combinator '_test_lint': \['bias_s0'\] name two things"):
        Combinator(
            name="_test_lint",
            role=Role.SCORE_MOD,
            doc="t",
            reference=lambda s, ctx, bias_s0: s,
            params=[Param(name="bias_s0", default=1.0)],
            tensors=[af.combinator.TensorArg(name="bias", rank=1)],
            prepare=lambda ctx, bias_s0: {},
            fragment=ScoreModFragment(body="s = s"),
        )


# Application prefixes (rope_0_, q_rope_0_, dk_rope_0_ ...) and a normaliser's own names are fragments'.
FRAGMENT_OWNED = re.compile(r"^(d?[qk]_)?[a-z]+(_[a-z]+)*_\d+(_|$)")
NORMALISER_NAMES = {
    "m_i",
    "l_i",
    "m_new",
    "m_use",
    "alpha",
    "l_use",
    "lse2",  # softmax's state
    "r_i",
    "r_new",
}  # relu_attention's running scale


@pytest.mark.parametrize("program", ["llama", "gpt2", "mistral", "alibi", "relu"])
@pytest.mark.parametrize("kernel", ["forward", "decode", "dkdv", "dq", "transform"])
def test_template_names_cover_generated_kernels(program, kernel):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 1, 24, 16, generator=g)
    try:
        source = getattr(examples, program).source(q, k, k, kernel=kernel)
    except Exception as exc:  # a program without that kernel (no qk transform to hoist)
        pytest.skip(f"{program} has no {kernel} kernel: {exc}")
    defined = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    unknown = {
        n
        for n in defined - TEMPLATE_NAMES - NORMALISER_NAMES
        if not _TEMPLATE_PATTERN.match(n) and not FRAGMENT_OWNED.match(n)
    }
    assert unknown == set()


def bad_call_program(device: str):
    """A score modification whose fragment passes the linter but calls a function Triton lacks."""
    bad = Combinator(
        name="_test_bad_call",
        role=Role.SCORE_MOD,
        doc="t",
        reference=MOD_REF,
        fragment=ScoreModFragment(body="s = tl.no_such_function(s)"),
    )

    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [bad]

    af.register_plugin(Plugin(), name="test-lint-bad-call")

    @af.attention
    def prog(q, k, v):
        return af.softmax(af._test_bad_call(af.scaled_dot_product(q, k))) @ v

    q = torch.randn(1, 1, 16, 16, generator=torch.Generator().manual_seed(0)).to(device)
    return prog, q


def test_error_inside_a_fragment_names_the_combinator():
    prog, q = bad_call_program("cpu")
    try:
        with pytest.raises(Exception, match="no_such_function") as info:
            prog(q, q, q)
    finally:
        af.unregister_plugin("test-lint-bad-call")
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert (
        "the failing line is in the fragment of combinator '_test_bad_call' of distribution "
        "'<registered in code: test-lint-bad-call>'" in notes
    )
    assert notes.endswith(": s = tl.no_such_function(s)")
