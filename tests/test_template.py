"""The Hopper forward template's CPU-side logic (``attnfuse/kernels``), with no GPU and no kernel compile: the
fragment rewrites (``gluon_text``), which programs it serves (``capability``), the record of verified
instances and how a call chooses one (``verified``, ``verify.record``), and that the runtime never runs an
unverified instance by default."""

from __future__ import annotations

import ast
import builtins
import math
import re
import string
import symtable
import textwrap
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnfuse as af
from attnfuse.combinator import INPUT, Combinator, NormaliserFragment, Role
from attnfuse.errors import InputError
from attnfuse.fragment_lint import _SITE, _fields, _markers
from attnfuse.kernels import capability, instance, verified, verify
from attnfuse.kernels.forward import RESCALE
from attnfuse.kernels.gluon_text import assigned, for_template, row_rescale
from attnfuse.kernels.tiles import FORWARD_TILES, ForwardTiles
from attnfuse.passes.compiler import compile as compile_plan
from attnfuse.passes.compiler import lowered
from attnfuse.plan import KernelConfig
from attnfuse.runtime import forward as runtime_forward
from attnfuse.testing.strategies import shapes

from conftest import stand_in

SM90 = KernelConfig(
    arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, group=2, save_lse=True, fp32_precision="ieee"
)
HEAD_DIMS = (64, 128, 256)
TEMPLATE_DTYPES = ("bfloat16", "float16")


def _graph(variant: str):
    """The graph of ``verify.FORWARD_VARIANTS[variant]`` (its runtime inputs made for a small CPU shape)."""
    program, extra = verify.FORWARD_VARIANTS[variant]
    return program.graph(**extra(4, 48, 64, "cpu"))


def _config(**changes) -> KernelConfig:
    return attrs.evolve(SM90, **changes)


def _forward_spec(graph, config: KernelConfig = SM90):
    """The forward template's spec of ``graph`` for ``config`` (the plan's own, hoisted where it hoists)."""
    plan = compile_plan(graph, config)
    return compile_plan(graph, plan.hoisted_config).templates.kernels["forward"]


# ---------------------------------------------------------------------------------------------------------
# 1. gluon_text.for_template


@pytest.mark.parametrize(
    "call,layout",
    [
        ('tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)', "ROW_LAYOUT"),
        ("tl.zeros([BLOCK_M], dtype=tl.float32)", "ROW_LAYOUT"),
        ("tl.zeros([BLOCK_N], dtype=tl.float32)", "KEY_LAYOUT"),
        ("tl.zeros([BLOCK_M, 1], dtype=tl.float32)", "S_LAYOUT"),
        ("tl.full([1, BLOCK_N], 2.0, tl.float32)", "S_LAYOUT"),
        ("tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)", "S_LAYOUT"),
        ("tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)", "S_LAYOUT"),
        ("tl.arange(0, BLOCK_N)", "KEY_LAYOUT"),
        ("tl.arange(0, BLOCK_M)", "ROW_LAYOUT"),
    ],
)
def test_for_template_gives_constructors_their_layout(call, layout):
    """A constructor becomes Gluon's with the layout its shape has in the score tile; its arguments stay."""
    text = f"""
        x_0 = {call}
        y_0 = tl.where(x_0 > 0, x_0, 1.0) + s
    """
    got = ast.parse(for_template(text)).body
    want = ast.parse(textwrap.dedent(text).strip()).body
    made = got[0].value
    assert isinstance(made, ast.Call) and ast.unparse(made.func) == f"gl.{want[0].value.func.attr}"
    assert [ast.unparse(a) for a in made.args] == [ast.unparse(a) for a in want[0].value.args]
    assert {k.arg: ast.unparse(k.value) for k in made.keywords} == {
        **{k.arg: ast.unparse(k.value) for k in want[0].value.keywords},
        "layout": layout,
    }
    assert ast.dump(got[1]) == ast.dump(want[1])  # the rest as written


def test_for_template_rewrites_nested_constructors():
    text = "m_i = tl.sum(tl.zeros([BLOCK_M, 1], dtype=tl.float32) + tl.arange(0, BLOCK_N)[None, :], 1)"
    got = for_template(text)
    assert "gl.zeros([BLOCK_M, 1], dtype=tl.float32, layout=S_LAYOUT)" in got
    assert "gl.arange(0, BLOCK_N, layout=KEY_LAYOUT)" in got
    assert got.startswith("m_i = tl.sum(") and "tl.zeros" not in got and "tl.arange" not in got


@pytest.mark.parametrize(
    "text",
    [
        "p = tl.math.exp2(s - m_i[:, None])\nl_i = l_i + tl.sum(p, 1)",
        "out = acc / l_i[:, None]  # a comment\nlse = m_i",
        "q_pos[:, None] >= k_pos[None, :]",
        "tl.zeros_like(s) + tl.full_like(s, 1.0)",  # constructors from a tensor keep its layout
    ],
)
def test_for_template_leaves_text_without_constructors_as_written(text):
    indented = textwrap.indent(text, " " * 12)
    assert for_template("\n" + indented + "\n    ") == text


@pytest.mark.parametrize(
    "call",
    [
        "tl.zeros([BLOCK_D], dtype=tl.float32)",
        "tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)",
        "tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)",
        "tl.zeros([2, BLOCK_N], dtype=tl.float32)",
        "tl.zeros(shape, dtype=tl.float32)",
        "tl.arange(0, BLOCK_D)",
        "tl.arange(0, BLOCK_N // 2)",
    ],
)
def test_for_template_leaves_shapes_of_no_tile_as_written(call):
    """A shape the template has no layout for stays a ``tl`` call (its compile error names the fragment)."""
    text = f"x_0 = {call}\ny_0 = tl.zeros([BLOCK_N], dtype=tl.float32)"
    got = ast.parse(for_template(text)).body
    assert ast.dump(got[0]) == ast.dump(ast.parse(f"x_0 = {call}").body[0])
    assert ast.unparse(got[1].value).startswith("gl.zeros(")  # the known one beside it is rewritten


def _parsable(comb: Combinator, text: str) -> str:
    """``text`` with its placeholders made identifiers, as the linter reads fragments."""
    code = string.Template(text).safe_substitute(_markers(comb))
    return string.Template(code).safe_substitute({n: f"_{n}_" for n in _SITE})


def _fragment(comb: Combinator, data) -> object:
    """``comb``'s fragment; a fragment function's for parameters drawn from its examples (runtime inputs given)."""
    if attrs.has(type(comb.fragment)):
        return comb.fragment
    shape = data.draw(shapes(max_n=64, head_dims=(16, 32)))
    drawn = comb.examples(data.draw, shape) if comb.examples else {}
    params = {p.name: drawn.get(p.name, p.default) for p in comb.params}
    given_input = lambda v: isinstance(v, torch.Tensor) or getattr(v, "__attnfuse_runtime_input__", False)  # noqa: E731
    return comb.fragment_for({n: INPUT if given_input(v) else v for n, v in params.items()})


def _registered() -> list[str]:
    return sorted(af.combinators())


@pytest.mark.parametrize("name", _registered())
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_every_registered_fragment_still_parses_for_the_template(name, data):
    """Every text field of every registered combinator's fragment (built-ins, contrib, legacy and other
    installed plugins), rewritten for the template, is still Python with the same calls, each made Gluon's
    with one layout."""
    comb = af.combinators()[name].combinator
    fields = [(path, _parsable(comb, text)) for path, text, _ in _fields(_fragment(comb, data)) if text.strip()]
    assert fields or comb.role in (Role.SCORE_SOURCE, Role.MASK)
    for path, code in fields:
        try:
            ast.parse(textwrap.dedent(code).strip())
        except SyntaxError:  # an expression written over lines: the template splices it in parentheses
            code = f"({textwrap.dedent(code).strip()})"
        rewritten = for_template(code)
        calls = [n for n in ast.walk(ast.parse(rewritten)) if isinstance(n, ast.Call)]
        assert len(calls) == sum(isinstance(n, ast.Call) for n in ast.walk(ast.parse(textwrap.dedent(code).strip())))
        made = [c for c in calls if ast.unparse(c.func).startswith("gl.")]
        assert all([k.arg for k in c.keywords].count("layout") == 1 for c in made), (path, rewritten)


# ---------------------------------------------------------------------------------------------------------
# 2. gluon_text.row_rescale and assigned


RESCALING = ("softmax", "softmax_with_sinks", "relu_attention", "legacy_softmax1")  # their updates rescale acc


@pytest.mark.parametrize(
    "name,field",
    [
        (n, f)
        for n in RESCALING
        for f in ("update", "scaled_update")
        if getattr(af.combinators()[n].combinator.fragment, f)
    ],
)
def test_row_rescale_moves_the_update_s_accumulator_factor_to_the_rows(name, field):
    comb = af.combinators()[name].combinator
    update = _parsable(comb, getattr(comb.fragment, field))
    rows_name = "acc_rows_7"
    got = row_rescale(update, rows_name)
    assert got is not None
    tree = ast.parse(got)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "acc" not in names and rows_name in names
    before = ast.parse(textwrap.dedent(update).strip()).body
    after = tree.body
    assert len(after) == len(before)
    for old, new in zip(before, after):  # each `acc = acc * X[:, None]` became `rows = rows * (X)`, no other
        if "acc" in {n.id for n in ast.walk(old) if isinstance(n, ast.Name)}:
            factor = old.value.right.value
            assert ast.dump(new) == ast.dump(ast.parse(f"{rows_name} = {rows_name} * ({ast.unparse(factor)})").body[0])
        else:
            assert ast.dump(new) == ast.dump(old)


@pytest.mark.parametrize(
    "line",
    [
        "acc = tl.where(acc > 0, acc, 0.0)",
        "out = acc + 1",
        "acc = acc + p[:, None]",
        "acc = acc * alpha",
        "acc = acc * alpha[None, :]",
        "acc = acc * alpha[:, 0]",
        "acc = acc * alpha[1:, None]",
        "acc = acc * alpha[::2, None]",
        "acc = acc * alpha[:, None, None]",
        "acc = alpha[:, None] * acc",
        "acc *= alpha[:, None]",
        "acc = acc * alpha[:, None] * 2.0",
        "acc = tl.maximum(acc, 0.0) * alpha[:, None]",
    ],
)
def test_row_rescale_refuses_any_other_use_of_acc(line):
    update = f"""
        alpha = tl.math.exp2(m_i - tl.max(s, 1))
        p = tl.math.exp2(s)
        {line}
    """
    assert row_rescale(update, "rows") is None


def test_row_rescale_leaves_updates_without_acc_unchanged():
    comb = af.combinators()["sigmoid_attention"].combinator
    update = _parsable(comb, comb.fragment.update)
    assert ast.dump(ast.parse(row_rescale(update, "rows"))) == ast.dump(ast.parse(textwrap.dedent(update).strip()))


@pytest.mark.parametrize("name", RESCALING)
def test_assigned_gives_the_init_s_state_in_order(name):
    comb = af.combinators()[name].combinator
    init = _parsable(comb, comb.fragment.init)
    want = re.findall(r"^\s*(\w+)\s*=", init, flags=re.M)
    assert want and assigned(init) == want


def test_assigned_reads_tuples_and_annotations_once():
    assert assigned("a, b = x, y\nc: int = 1\na = b\nd += 1") == ["a", "b", "c", "d"]
    assert assigned("") == [] and assigned("   \n") == []


# ---------------------------------------------------------------------------------------------------------
# 3. capability.forward_reason


@pytest.mark.parametrize("variant", sorted(verify.FORWARD_VARIANTS))
@pytest.mark.parametrize("dtype", TEMPLATE_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_template_serves_every_verified_variant(variant, dtype, head_dim):
    graph = _graph(variant)
    config = compile_plan(graph, _config(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim)).hoisted_config
    assert capability.forward_reason(lowered(graph, config)) is None


def _undefined(source: str) -> list[str]:
    """The names a function of ``source`` reads as globals that the module neither defines nor imports."""
    table = symtable.symtable(source, "<template instance>", "exec")
    module = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    read, scopes = set(), list(table.get_children())
    while scopes:
        scope = scopes.pop()
        scopes += scope.get_children()
        read |= {s.get_name() for s in scope.get_symbols() if s.is_global() and s.is_referenced()}
    return sorted(n for n in read - module if not hasattr(builtins, n))


@pytest.mark.parametrize("variant", sorted(verify.FORWARD_VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_served_instances_splice_into_complete_gluon_text(variant, head_dim):
    """Each served instance's source (generated, not compiled) is Python, creates no tensor without a layout
    (no ``tl.full``/``tl.zeros``/``tl.arange`` left) and reads no name that it does not define."""
    source = _forward_spec(_graph(variant), _config(head_dim=head_dim, head_dim_v=head_dim)).source
    calls = [ast.unparse(n.func) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    assert not {"tl.full", "tl.zeros", "tl.arange"} & set(calls)
    assert _undefined(source) == []


@af.attention
def _dense(q, k, v, scale):
    return af.softmax(af.full(af.scaled_dot_product(q, k, scale=scale))) @ v


@pytest.mark.parametrize("sign", [-1.0, 0.0, 1.0])
def test_served_instances_fold_the_scale_into_the_update_only_when_it_is_positive(sign):
    """The scaled update takes ``s * qk_scale`` with qk_scale > 0 (a masked -inf stays -inf, the row max
    commutes); a scale not above 0 is applied to the scores first, as the generated kernels do."""
    scale = sign * float(torch.empty(()).uniform_(0.05, 2.0))
    plan = compile_plan(_dense.graph(scale), SM90)
    source = plan.templates.kernels["forward"].source
    assert plan.templates.scale == scale and ("s = s * sm_scale" in source) == (scale <= 0)
    assert ("m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)" in source) == (scale > 0)


@pytest.mark.parametrize(
    "changes,cause",
    [
        ({"arch": "interpreter"}, "interpreter"),
        ({"arch": "sm80"}, "sm80"),
        ({"dtype": "float32"}, "float32"),
        ({"dtype": "float64"}, "float64"),
        ({"head_dim": 96, "head_dim_v": 96}, "96"),
        ({"head_dim": 32, "head_dim_v": 32}, "32"),
        ({"head_dim_v": 64}, "D == DV (got 128 and 64)"),
        ({"paged": True}, "paged"),
        ({"wide_positions": True}, "2**30"),
        ({"positions": True, "wide_positions": True}, "2**30"),
        ({"partial": True}, "partial"),
    ],
)
@pytest.mark.parametrize("variant", ["causal", "sinks"])
def test_forward_reason_names_what_the_template_does_not_take(variant, changes, cause):
    graph = _graph(variant)
    assert capability.forward_reason(lowered(graph, SM90)) is None
    reason = capability.forward_reason(lowered(graph, _config(**changes)))
    assert reason is not None and cause in reason


FACTS = ("kv_lens", "positions", "varlen")


@pytest.mark.parametrize("fact", FACTS)
@pytest.mark.parametrize("variant", ["causal", "sinks", "sliding_window"])
def test_the_forward_template_takes_a_call_s_facts_and_the_backward_templates_packed_calls(variant, fact):
    """kv_lens and given positions: the forward template's alone (the backward templates name them); packed
    sequences: all three templates'."""
    graph = _graph(variant)
    program = lowered(graph, _config(**{fact: True}))
    assert capability.forward_reason(program) is None
    reason = capability.dkdv_reason(program)
    if fact == "varlen":
        assert reason is None and capability.dq_reason(program) is None
    else:
        assert reason is not None and "dK/dV" in reason and fact in reason


@pytest.mark.parametrize("fact", FACTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_instances_of_a_call_with_a_fact_splice_into_complete_gluon_text(fact, head_dim):
    """As ``test_served_instances_splice_into_complete_gluon_text``, for each fact: the instance reads the
    fact's parameters (the launch passes them) and defines every name it reads."""
    spec = _forward_spec(_graph("causal"), _config(head_dim=head_dim, head_dim_v=head_dim, **{fact: True}))
    calls = [ast.unparse(n.func) for n in ast.walk(ast.parse(spec.source)) if isinstance(n, ast.Call)]
    assert not {"tl.full", "tl.zeros", "tl.arange"} & set(calls)
    assert _undefined(spec.source) == []
    given = {"kv_lens": {"KvLens"}, "positions": {"Q_OFFSET", "K_OFFSET", "N_SEQ"}, "varlen": {"CuQ", "CuK", "DOCS"}}
    assert given[fact] <= {p.name for p in spec.launch.params}


def test_forward_reason_refuses_a_qk_transform_inside_the_kernel():
    graph = _graph("rope_causal")
    plan = compile_plan(graph, SM90)
    assert plan.hoisted_config != SM90  # the served config is the hoisted one, tested above
    reason = capability.forward_reason(lowered(graph, SM90))
    assert reason is not None and "qk transform" in reason and "hoisted" in reason


@af.attention
def _block_sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.causal(af.scaled_dot_product(q, k)), block_mask)) @ v


def test_a_mask_that_lists_its_blocks_runs_every_template():
    keep = torch.rand(1, 2, 2, 2) < 0.7
    block_mask = af.create_block_mask_from_blocks(
        lambda b, h, qb, kb: (qb == kb) | keep[b, h, qb, kb], 1, 2, 256, 256, block_size=128
    )
    kernel = lowered(_block_sparse.graph(block_mask), SM90)
    assert capability.forward_reason(kernel) is None and capability.dkdv_reason(kernel) is None
    assert capability.dq_reason(kernel) is None


def _relu_like_reference(s, keep, ctx):
    weights = torch.relu(s)
    return (weights if keep is None else weights.masked_fill(~keep, 0.0)), None


def _normaliser(name: str, rescale: str, scaled_rescale: str | None = None) -> Combinator:
    """A third party's unnormalised relu normaliser keeping its weights under a running row maximum ``z_i``:
    ``rescale`` is the update's line that rescales acc by the old maximum over the new; ``scaled_rescale``,
    where given, the same line of a ``scaled_update`` (the update on unscaled scores)."""
    update = """
        p = tl.maximum(s{factor}, 0.0)
        z_new = tl.maximum(z_i, tl.max(p, 1))
        {rescale}
        p = p / z_new[:, None]
        z_i = z_new
    """
    scaled = scaled_rescale and update.format(factor=" * $factor", rescale=scaled_rescale)
    return Combinator(
        name=name,
        role=Role.NORMALISER,
        doc="relu weights, unnormalised (a test plugin).",
        reference=_relu_like_reference,
        fragment=NormaliserFragment(
            masked_score="0.0",
            init="z_i = tl.full([BLOCK_M], 1.0, dtype=$acc_dtype)",
            update=update.format(factor="", rescale=rescale),
            scaled_update=scaled or "",
            finalize="out = acc * z_i[:, None]",
            combine="sum",
        ),
    )


RESCALED = "acc = acc * (z_i / z_new)[:, None]"  # a row factor
CLIPPED = "acc = tl.maximum(acc, 0.0) * (z_i / z_new)[:, None]"  # not linear in acc
LINEAR = _normaliser("_test_template_linear", RESCALED, RESCALED)
NONLINEAR = _normaliser("_test_template_clipped", CLIPPED)
NONLINEAR_SCALED = _normaliser("_test_template_clipped_scaled", RESCALED, CLIPPED)


class _Plugin:
    def __init__(self, combinator: Combinator):
        self.combinator = combinator

    @af.hookimpl
    def attnfuse_combinators(self):
        return [self.combinator]


@pytest.fixture
def third_party_normalisers():
    registered = []
    try:
        for comb in (LINEAR, NONLINEAR, NONLINEAR_SCALED):
            af.register_plugin(_Plugin(comb), name=f"template-test:{comb.name}")
            registered.append(f"template-test:{comb.name}")
        yield
    finally:
        for name in reversed(registered):
            af.unregister_plugin(name)


def _normalised_by(name: str):
    normaliser = getattr(af, name)
    return af.attention(lambda q, k, v: normaliser(af.causal(af.scaled_dot_product(q, k))) @ v).graph()


@pytest.mark.parametrize("comb", [NONLINEAR, NONLINEAR_SCALED], ids=["update", "scaled_update"])
def test_forward_reason_refuses_a_third_party_update_that_changes_acc_otherwise(comb, third_party_normalisers):
    reason = capability.forward_reason(lowered(_normalised_by(comb.name), SM90))
    assert reason is not None and comb.name in reason and "acc = acc * f[:, None]" in reason
    assert "forward" not in compile_plan(_normalised_by(comb.name), SM90).templates.kernels


def test_the_template_serves_a_third_party_normaliser_by_its_update_s_form(third_party_normalisers):
    plan = compile_plan(_normalised_by(LINEAR.name), SM90)
    assert capability.forward_reason(lowered(_normalised_by(LINEAR.name), SM90)) is None
    source = plan.templates.kernels["forward"].source  # generated text, not compiled
    assert _undefined(source) == []
    tree = ast.parse(source)
    assigned_names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    assert {"z_i", "z_new", RESCALE} <= assigned_names
    assert f"{RESCALE} = {RESCALE} * (z_i / z_new)" in source and "acc = acc * (z_i / z_new)" not in source


def test_float8_takes_the_template_only_for_a_normaliser_that_declares_unit_weights(third_party_normalisers):
    """Float8 P·V rounds 256 · P to e4m3 with no range check: a normaliser not declaring its weights at most 1
    runs the generated float8 kernel, by name in the reason; declared, the same normaliser runs the template."""
    fp8 = attrs.evolve(SM90, dtype="float8_e4m3fn", save_lse=False)
    reason = capability.forward_reason(lowered(_normalised_by(LINEAR.name), fp8))
    assert reason is not None and LINEAR.name in reason and "unit_weights" in reason
    assert capability.forward_reason(lowered(_normalised_by(LINEAR.name), SM90)) is None  # bfloat16 takes it
    unit = attrs.evolve(LINEAR.fragment, unit_weights=True)
    declared = attrs.evolve(LINEAR, name="_test_template_unit", fragment=unit)
    af.register_plugin(_Plugin(declared), name="template-test:unit")
    try:
        assert capability.forward_reason(lowered(_normalised_by(declared.name), fp8)) is None
    finally:
        af.unregister_plugin("template-test:unit")


def test_capability_names_no_combinator(third_party_normalisers):
    """The template serves programs by what their lowered form declares, never by a combinator's name: the
    contrib sigmoid_attention and a third party's normaliser above are served though no code names them."""
    text = Path(capability.__file__).read_text()
    named = [n for n in af.combinators() if re.search(rf"\b{re.escape(n)}\b", text)]
    assert named == []
    assert capability.forward_reason(lowered(_normalised_by(LINEAR.name), SM90)) is None
    if "sigmoid_attention" in af.combinators():  # the contrib package, where installed
        assert capability.forward_reason(lowered(_normalised_by("sigmoid_attention"), SM90)) is None


# ---------------------------------------------------------------------------------------------------------
# 4. verified: the record's keys, the mode, the choice


@pytest.fixture
def fresh_library():
    """The library modules' sources (``instance._module_source``) read again for the test, and again after it."""
    instance._module_source.cache_clear()
    yield
    instance._module_source.cache_clear()


def test_record_key_names_the_program_dtype_and_head_dim():
    causal, sinks = _forward_spec(_graph("causal")), _forward_spec(_graph("sinks"))
    keys = {
        verified.record_key(causal, "bfloat16", 128),
        verified.record_key(sinks, "bfloat16", 128),
        verified.record_key(causal, "float16", 128),
        verified.record_key(causal, "bfloat16", 64),
    }
    assert len(keys) == 4
    assert all(k.startswith("forward/") for k in keys)


@pytest.mark.parametrize(
    "changed, changes",
    [
        ("pipeline.py", True),
        ("rows.py", True),
        ("launch.py", True),
        ("template_rows.py", True),
        ("dkdv_pipeline.py", False),
    ],
)
def test_record_key_changes_with_the_template_library(changed, changes, fresh_library, monkeypatch):
    """A forward instance's key follows the modules its source imports and those that launch it, and not a module
    it does not import (the dK/dV template's)."""
    spec = _forward_spec(_graph("causal"))
    before = verified.record_key(spec, "bfloat16", 128)
    read_text = Path.read_text

    def edited(path, *args, **kwargs):
        text = read_text(path, *args, **kwargs)
        return text + "\n# edited\n" if Path(path).name == changed else text

    instance._module_source.cache_clear()
    monkeypatch.setattr(Path, "read_text", edited)
    assert (verified.record_key(spec, "bfloat16", 128) != before) is changes


@pytest.mark.parametrize("kind", ["forward", "dkdv", "dq"])
def test_only_a_dq_instances_record_key_changes_with_the_dq_launch(kind, fresh_library, monkeypatch):
    """``kernels/dq_launch.py`` launches the dQ template's instances alone: its change changes their keys, and
    leaves the forward's and the dK/dV template's verified."""
    graph = _graph("causal")
    spec = compile_plan(graph, compile_plan(graph, _config(save_lse=True)).hoisted_config).templates.kernels[kind]
    before = verified.record_key(spec, "bfloat16", 128)
    read_text = Path.read_text

    def edited(path, *args, **kwargs):
        text = read_text(path, *args, **kwargs)
        return text + "\n# edited\n" if Path(path).name == "dq_launch.py" else text

    instance._module_source.cache_clear()
    monkeypatch.setattr(Path, "read_text", edited)
    assert (verified.record_key(spec, "bfloat16", 128) != before) is (kind == "dq")


def test_record_key_changes_with_the_tiles_an_instance_launches_with(monkeypatch):
    """A change of the tiles an instance runs (``tiles.FORWARD_TILES``: keys per step, stages) is a change of
    the kernel the GPU ran: the record must not carry the old verification over to it."""
    graph = _graph("causal")
    before = _forward_spec(graph)
    tiles = FORWARD_TILES[128]
    monkeypatch.setitem(FORWARD_TILES, 128, ForwardTiles(block_n=tiles.block_n // 2, stages=tiles.stages - 1))
    after = _forward_spec(graph)
    assert after.tiles != before.tiles
    assert verified.record_key(after, "bfloat16", 128) != verified.record_key(before, "bfloat16", 128)


@pytest.mark.parametrize("value", ["yes", "ALL", "verified,all", "1", "forward,decode", "dkdv,"])
def test_mode_refuses_an_unknown_value(value, monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, value)
    with pytest.raises(InputError) as caught:
        verified.mode()
    message = str(caught.value)
    assert "ATTNFUSE_TEMPLATES" in message and repr(value) in message
    assert all(m in message for m in ("verified", "all", "off"))


@pytest.mark.parametrize("value,mode", [(None, "verified"), ("", "verified"), (" all ", "all"), ("off", "off")])
def test_mode_reads_the_variable(value, mode, monkeypatch):
    if value is None:
        monkeypatch.delenv(verified.MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(verified.MODE_ENV, value)
    assert verified.mode() == mode


@pytest.mark.parametrize("value", ["dkdv", "forward, dq"])
def test_a_list_of_kinds_opts_in_to_those_kinds_alone(value, monkeypatch):
    """``ATTNFUSE_TEMPLATES=forward,dq``: every instance of the kinds listed, the verified ones of the others."""
    listed = [kind.strip() for kind in value.split(",")]
    monkeypatch.setenv(verified.MODE_ENV, value)
    monkeypatch.setattr(verified, "is_verified", lambda key: key.endswith("/recorded"))
    for kind in verified.KINDS:
        assert verified.chosen(f"{kind}/abc/bfloat16/128") is (kind in listed)
        assert verified.chosen(f"{kind}/recorded") is True


@pytest.mark.parametrize(
    "mode,recorded_runs,other_runs",
    [("verified", True, False), (None, True, False), ("all", True, True), ("off", False, False)],
)
def test_chosen_runs_what_the_mode_allows(mode, recorded_runs, other_runs, record, monkeypatch):
    if mode is None:
        monkeypatch.delenv(verified.MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(verified.MODE_ENV, mode)
    spec = _forward_spec(_graph("causal"))
    recorded, other = (verified.record_key(spec, t, 128) for t in TEMPLATE_DTYPES)
    record([recorded])
    assert verified.chosen(recorded) is recorded_runs
    assert verified.chosen(other) is other_runs
    record(None)  # no record at all: nothing is verified
    assert verified.chosen(recorded) is other_runs


# ---------------------------------------------------------------------------------------------------------
# 5. verify.record and verify.cases


def _results(key: str, errors: list[float]) -> list[dict]:
    return [{"key": key, "case": f"{key}-case{i}", "max_error": e} for i, e in enumerate(errors)]


def test_record_keeps_only_instances_all_of_whose_cases_passed():
    errors = {k: torch.rand(int(torch.randint(1, 6, ()))).tolist() for k in ("forward/a", "forward/b", "forward/c")}
    results = [r for k, e in errors.items() for r in _results(k, e)]
    results = [results[i] for i in torch.randperm(len(results)).tolist()]  # the order the GPU ran them in
    run = {"gpu": "test"}
    data = verify.record(results, {"forward/b", "forward/never-passed"}, run)
    assert data["run"] == run
    assert {e["key"] for e in data["instances"]} == {"forward/a", "forward/c"}
    for entry in data["instances"]:
        assert entry["cases"] == len(errors[entry["key"]])
        assert entry["max_error"] == max(errors[entry["key"]])


def test_a_run_of_some_cases_adds_to_the_record():
    """``verify --add-to``: the earlier record's instances stay (each naming its run) unless this run failed a
    case of theirs; this run's passed instances join it, replacing an earlier entry of their key."""
    first = verify.record(_results("forward/a", [0.1]) + _results("forward/b", [0.2]), set(), {"gpu": "one"})
    second_run = verify.record(
        _results("forward/c", [0.3]) + _results("forward/a", [0.05]), {"forward/b"}, {"gpu": "two"}
    )
    data = verify.added(first, second_run, {"forward/b"})
    assert data["runs"] == [{"gpu": "one"}, {"gpu": "two"}]
    assert {e["key"]: (e["run"], e["max_error"]) for e in data["instances"]} == {
        "forward/a": (1, 0.05),
        "forward/c": (1, 0.3),
    }
    third = verify.added(data, verify.record(_results("forward/d", [0.4]), set(), {"gpu": "three"}), set())
    assert [e["run"] for e in third["instances"]] == [1, 1, 2] and len(third["runs"]) == 3


def test_pruning_keeps_the_instances_the_cases_run_and_their_runs():
    """``verify --prune``: an instance whose source changed (its old key) leaves the record, and so does a run
    no kept instance comes from; the kept entries point at their runs renumbered."""
    first = verify.record(_results("forward/old", [0.1]), set(), {"gpu": "one"})
    second = verify.record(_results("forward/a", [0.2]), set(), {"gpu": "two"})
    data = verify.added(
        verify.added(first, second, set()), verify.record(_results("forward/b", [0.3]), set(), {}), set()
    )
    kept = verify.pruned(data, {"forward/a", "forward/b", "forward/never-run"})
    assert kept["runs"] == [{"gpu": "two"}, {}]
    assert {e["key"]: e["run"] for e in kept["instances"]} == {"forward/a": 0, "forward/b": 1}
    single = verify.pruned(first, set())
    assert single["run"] == {"gpu": "one"} and single["instances"] == []


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("position", ["first", "last"])
def test_record_leaves_out_an_instance_with_a_non_finite_error(bad, position):
    errors = torch.rand(3).tolist()
    errors = [bad, *errors] if position == "first" else [*errors, bad]
    data = verify.record(_results("forward/a", errors) + _results("forward/b", [0.01]), set(), {})
    assert [e["key"] for e in data["instances"]] == ["forward/b"]


def test_record_is_empty_when_nothing_passed():
    assert verify.record([], set(), {})["instances"] == []
    assert verify.record(_results("forward/a", [0.1]), {"forward/a"}, {})["instances"] == []


def test_cases_cover_every_variant_head_dim_and_dtype():
    found = verify.cases()
    covered = {(c.variant, c.head_dim, c.dtype) for c in found if not c.poison}
    fp8 = {(v, d, t) for v in verify.FP8_VARIANTS for d in capability.FORWARD_FP8_HEAD_DIMS for t in verify.FP8_DTYPES}
    every = {(v, d, t) for v in verify.FORWARD_VARIANTS for d in verify.HEAD_DIMS for t in verify.DTYPES}
    assert covered == every | fp8
    assert set(verify.HEAD_DIMS) == set(HEAD_DIMS) and set(verify.DTYPES) == set(TEMPLATE_DTYPES)
    assert len({c.id for c in found}) == len(found)  # each case its own test id
    assert all(c.shape[1] % c.shape[2] == 0 for c in found)  # (B, Hq, Hkv, Nq, Nk)
    assert any(c.shape[1] > c.shape[2] for c in found)  # GQA
    assert any(c.shape[3] % 64 and c.shape[4] % 64 for c in found)  # lengths off the tiles
    assert any(c.shape[3] != c.shape[4] for c in found)


def test_fp8_cases_cover_the_softmax_variants_the_float8_template_runs():
    """Every variant whose normaliser saves lse and that has no qk transform (a float8 call runs transforms inside
    its kernel), at the float8 head dims; each case's plan runs the forward template."""
    assert {"causal", "dense", "sliding_window", "causal_alibi", "softcap", "sinks"} <= set(verify.FP8_VARIANTS)
    assert set(verify.LISTED_VARIANTS) <= set(verify.FP8_VARIANTS)  # block lists: the loader reads V's copy
    assert not {"rope_causal", "relu"} & set(verify.FP8_VARIANTS)
    found = verify.fp8_cases()
    for c in found:
        plan = verify.variant_plan(c.variant, c.dtype, c.head_dim, c.fact)
        assert "forward" in plan.templates.kernels, plan.templates.reasons["forward"]
    every = {(v, d) for v in verify.FP8_VARIANTS for d in capability.FORWARD_FP8_HEAD_DIMS}
    assert {(c.variant, c.head_dim) for c in found if c.poison and not c.fact} == every  # the careful redo's rows
    unlisted = {(v, d) for v, d in every if v in verify.VARIANTS}  # the template follows lists in no call with a fact
    for fact in ("kv_lens", "positions", "varlen"):  # kv_lens with NaN keys and values past each sequence's length
        assert {(c.variant, c.head_dim, c.poison) for c in found if c.fact == fact} == {
            (v, d, fact == "kv_lens") for v, d in unlisted if fact != "varlen" or v != "sigmoid"
        }
    assert {(c.variant, c.out_dtype) for c in found if c.out_dtype} == {
        (v, out) for v in verify.FP8_VARIANTS for out in ("float16", "float32")
    }
    assert len({c.id for c in found}) == len(found)


def test_fact_cases_cover_each_fact_at_every_head_dim_and_dtype_with_the_lengths_that_matter():
    found = verify.fact_cases()
    assert {c.fact for c in found} == set(FACTS) and all(c in verify.cases() for c in found)
    for fact in FACTS:
        mine = [c for c in found if c.fact == fact]
        assert {(c.head_dim, c.dtype) for c in mine} == {(d, t) for d in HEAD_DIMS for t in TEMPLATE_DTYPES}
        assert all(c.shape[1] > c.shape[2] for c in mine)  # GQA
        assert {"causal", "dense", "sinks"} <= {c.variant for c in mine}
        for c in mine:  # each case's plan runs the forward template
            plan = verify.variant_plan(c.variant, c.dtype, c.head_dim, c.fact)
            assert "forward" in plan.templates.kernels, plan.templates.reasons["forward"]
    lens, block = verify.KV_LENS, FORWARD_TILES[128].block_n
    assert 0 in lens and max(lens) > block and any(n % 64 for n in lens) and max(lens) == verify.KV_LENS_SHAPE[4]
    assert all(c.poison for c in found if c.fact == "kv_lens")  # NaN keys and values past each length
    at = verify.POSITIONS
    assert at["q_offset"] < at["k_offset"]  # rows that keep no causal key
    lengths = [n for doc in verify.DOCUMENTS for n in doc]
    assert {0, 1} <= set(lengths) and any(n % 64 and n > 128 for n in lengths)
    assert any(nq and not nk for nq, nk in verify.DOCUMENTS) and any(nq > nk > 0 for nq, nk in verify.DOCUMENTS)


# ---------------------------------------------------------------------------------------------------------
# 6. The runtime runs no unverified instance by default


@pytest.fixture
def recorder(monkeypatch):
    """``TemplateForward``'s stand-in: its constructions recorded instead of compiled."""
    return stand_in(monkeypatch, runtime_forward, "TemplateForward")


@pytest.mark.parametrize("variant", sorted(verify.FORWARD_VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_plans_have_no_template(variant, dtype, recorder, monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, "all")
    plan = compile_plan(_graph(variant), _config(arch="interpreter", dtype=dtype, head_dim=32, head_dim_v=32))
    assert plan.templates.kernels == {} and "interpreter" in plan.templates.reasons["forward"]
    assert runtime_forward.template_forward(plan) is None and recorder.made == []


def test_a_cpu_call_runs_the_generated_kernel_under_any_mode(recorder, monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, "all")
    cap = float(torch.empty(()).uniform_(10.0, 30.0))  # a program of its own: its kernel is made by this call
    program = af.attention(lambda q, k, v: af.softmax(af.softcap(af.causal(af.scaled_dot_product(q, k)), cap=cap)) @ v)
    q, k, v = (torch.randn(1, 2, n, 16) for n in (24, 40, 40))
    out = program(q, k, v)
    assert recorder.made == []
    ref = program.reference(q, k, v)
    af.testing.assert_matches_reference(out, ref, program.reference(q, k, v, dtype=q.dtype), q.dtype)


@pytest.mark.parametrize("variant", ["causal", "sinks", "rope_causal"])
def test_an_unrecorded_sm90_instance_runs_only_when_opted_in(variant, record, recorder, monkeypatch):
    graph = _graph(variant)
    plan = compile_plan(graph, compile_plan(graph, SM90).hoisted_config)
    spec = plan.templates.kernels["forward"]
    key = verified.record_key(spec, plan.config.dtype, plan.config.head_dim)
    record([])
    for mode in (None, "verified", "off"):
        if mode is None:
            monkeypatch.delenv(verified.MODE_ENV, raising=False)
        else:
            monkeypatch.setenv(verified.MODE_ENV, mode)
        assert runtime_forward.template_forward(plan) is None
    assert recorder.made == []
    monkeypatch.setenv(verified.MODE_ENV, "all")
    assert isinstance(runtime_forward.template_forward(plan), recorder)
    assert recorder.made == [(spec, plan.templates.scale, plan.templates.qk_scale, key)]


@pytest.mark.parametrize("dtype,other", [("bfloat16", "float16"), ("float16", "bfloat16")])
def test_a_recorded_sm90_instance_runs_by_default(dtype, other, record, recorder, monkeypatch):
    monkeypatch.delenv(verified.MODE_ENV, raising=False)
    plan = compile_plan(_graph("causal"), _config(dtype=dtype))
    spec = plan.templates.kernels["forward"]
    key = verified.record_key(spec, dtype, 128)
    record([verified.record_key(spec, other, 128)])  # another dtype's instance of the same source
    assert runtime_forward.template_forward(plan) is None
    record([key])
    assert isinstance(runtime_forward.template_forward(plan), recorder)
    assert recorder.made == [(spec, plan.templates.scale, plan.templates.qk_scale, key)]
