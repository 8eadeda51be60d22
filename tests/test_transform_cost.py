"""``passes/transform_cost.py`` and what ``attnfuse show`` prints of it: the per-row FLOPs and table bytes of a
program's qk transforms (the fused-or-hoisted rule's inputs), counted from the fragments' text. The expected
counts are worked out by hand from each fragment's statements (the operations and the loads a row makes)."""

from __future__ import annotations

import json

import pytest
import torch

import attnfuse as af
from attnfuse.cli import main
from attnfuse.combinator import Combinator, QKTransformFragment, Role
from attnfuse.examples import gpt2
from attnfuse.passes.compiler import lowered
from attnfuse.passes.transform_cost import transform_cost
from attnfuse.plan import KernelConfig
from attnfuse.runtime.hoisted import HOIST_MIN_QUERY_BLOCKS


def config(dtype="bfloat16", head_dim=64, **changes) -> KernelConfig:
    base = dict(arch="sm90", dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, group=1, save_lse=False)
    return KernelConfig(fp32_precision="ieee", **{**base, **changes})


def cost_of(program, cfg, **arguments):
    return transform_cost(lowered(program.graph(**arguments), cfg))


@af.attention
def rope_theta(q, k, v, rotate_keys=True):
    return af.softmax(af.causal(af.rope(q, k, rotate_keys=rotate_keys))) @ v


@af.attention
def rope_tables(q, k, v, cos, sin):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


@af.attention
def normed(q, k, v, wq, wk):
    return af.softmax(af.causal(af.scaled_dot_product(*af.qk_norm(q, k, wq, wk)))) @ v


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_rope_costs_six_operations_and_its_tables_a_row(head_dim, dtype):
    """x1' = x1·c − x2·s and x2' = x2·c + x1·s: 6 operations on each of D/2 elements. With theta one (D/2)
    table of cos and one of sin serve both halves (2 loads); given tables read a column range a half (4)."""
    table_bytes = 8 if dtype == "float64" else 4
    element = {"float16": 2, "float32": 4, "float64": 8}[dtype]
    cfg = config(dtype, head_dim)
    theta = cost_of(rope_theta, cfg)
    assert (theta.q.flops, theta.q.table_bytes) == (6 * head_dim // 2, 2 * head_dim // 2 * table_bytes)
    assert theta.k == theta.q
    assert theta.pass_bytes == 2 * head_dim * element
    table = torch.ones(8, head_dim)  # a runtime input: only its presence matters to the kernel
    given = cost_of(rope_tables, cfg, cos=table, sin=table)
    assert (given.k.flops, given.k.table_bytes) == (6 * head_dim // 2, 4 * head_dim // 2 * table_bytes)
    cached = cost_of(rope_theta, cfg, rotate_keys=False)  # keys rotated in the cache: nothing to do on k
    assert (cached.k.flops, cached.k.table_bytes) == (0, 0) and cached.q == theta.q


def test_a_weight_read_once_a_tile_is_no_table_a_row():
    """qk_norm's weights are the same for every row (their load reads no position): no table bytes. Its
    statements: r = 1 / sqrt((sum(x1·x1) + sum(x2·x2)) / (2·HALF) + eps) is 10 operations, then x·r·w two a
    half (x·r one without a weight)."""
    cfg = config(head_dim=64)
    weighted = cost_of(normed, cfg, wq=torch.ones(64), wk=torch.ones(64))  # runtime weights on both sides
    assert (weighted.q.flops, weighted.q.table_bytes) == ((10 + 2 + 2) * 32, 0)
    bare = transform_cost(
        lowered(af.attention(lambda q, k, v: af.softmax(af.scaled_dot_product(*af.qk_norm(q, k))) @ v).graph(), cfg)
    )
    assert bare.q.flops == (10 + 1 + 1) * 32 and bare.k == bare.q


def test_a_third_party_transform_is_counted_from_its_own_text():
    """A transform nobody registered before is counted from its own text like a built-in: q's rows scaled by
    pos·0.5 + 1 (two operations), x1·s, and −x2·s (two): five a half; it reads no table."""
    scaled = Combinator(
        name="_test_position_scale",
        role=Role.QK_TRANSFORM,
        doc="q and k rows scaled by a per-position table, plus one.",
        params=[],
        reference=lambda q, k, ctx: (q, k),
        fragment=QKTransformFragment(
            q="${tmp}_s = $pos[:, None] * 0.5 + 1.0\n$x1 = $x1 * ${tmp}_s\n$x2 = -$x2 * ${tmp}_s\n",
        ),
    )

    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [scaled]

    af.register_plugin(Plugin(), name="test-transform-cost")
    try:
        program = af.attention(lambda q, k, v: af.softmax(af.scaled_dot_product(*af._test_position_scale(q, k))) @ v)
        cost = cost_of(program, config(head_dim=32, dtype="float32"))
    finally:
        af.unregister_plugin("test-transform-cost")
    assert (cost.q.flops, cost.q.table_bytes) == (5 * 16, 0)
    assert (cost.k.flops, cost.k.table_bytes) == (0, 0)


def test_no_transform_no_cost():
    assert transform_cost(lowered(gpt2.graph(), config())) is None


def test_show_prints_the_choice_and_its_inputs(capsys):
    assert main(["show", "llama", "--arch", "sm90", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["transforms"]
    block_m = 128  # the sm90 forward's, as the engines section reports it
    least = (HOIST_MIN_QUERY_BLOCKS - 1) * block_m + 1
    assert report == {
        "names": ["rope_0"],
        "hoisted_from_queries": least,
        "q_row": {"flops": 384, "table_bytes": 512},
        "k_row": {"flops": 384, "table_bytes": 512},
        "pass_bytes_per_row": 512,
    }
    assert main(["show", "llama", "--arch", "sm90", "--json", "--varlen"]) == 0  # packed calls hoist alike
    assert json.loads(capsys.readouterr().out)["transforms"]["hoisted_from_queries"] == least
    assert main(["show", "llama", "--arch", "sm90", "--json", "--dtype", "float8_e4m3fn"]) == 0  # float8: never
    assert json.loads(capsys.readouterr().out)["transforms"]["hoisted_from_queries"] is None
    assert main(["show", "gpt2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["transforms"] is None
    assert main(["show", "llama", "--arch", "sm90"]) == 0
    text = capsys.readouterr().out
    section = text[text.index("# transforms") : text.index("# source")].splitlines()
    assert section[1].strip().startswith(f"rope_0: hoisted into a pass in calls with at least {least} queries")
    assert section[2].strip() == "a row costs at most: q 384 FLOPs and 512 table bytes, k 384 FLOPs and 512 table bytes"
