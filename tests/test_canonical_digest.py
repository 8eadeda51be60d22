"""``kernels/canonical.py``: a template instance is named by its code, not its names. Programs whose kernels differ
only in names, docstrings or parameters nothing reads share one instance (and one GPU verification); any change
to the code (a literal, an operation, a tile) makes another."""

from __future__ import annotations

import ast

import attrs
import pytest
import torch

import attnfuse as af
import attnfuse.hf
from attnfuse.examples import llama
from attnfuse.kernels import verify
from attnfuse.kernels.canonical import canonical_source
from attnfuse.kernels.instance import instance_digest
from attnfuse.plan import KernelConfig
from attnfuse.runtime.compiled import compiled

SM90 = KernelConfig(
    arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, group=4, save_lse=False, fp32_precision="ieee"
)


def digest(graph, kind: str = "forward", hoisted: bool = False, **config) -> str:
    """The digest of ``graph``'s ``kind`` instance (dK/dV and dQ: with the lse saved), of the plan for transformed
    rows when ``hoisted``."""
    cfg = attrs.evolve(SM90, save_lse=kind in ("dkdv", "dq"), **config)
    plan = compiled(graph, cfg).plan
    if hoisted:
        plan = compiled(graph, plan.hoisted_config).plan
    return instance_digest(plan.templates.kernels[kind])


@af.attention
def qwen3(q, k, v, wq, wk, cos, sin):
    return af.softmax(af.causal(af.rope(*af.qk_norm(q, k, wq, wk, eps=1e-5), cos=cos, sin=sin))) @ v


def hf_graph(**arguments):
    base = dict(bias=None, cos=None, sin=None, scale=None, window=None, causal=True, rotate_keys=True)
    return attnfuse.hf.hf_attention.graph(**{**base, **arguments})


@pytest.mark.parametrize("kind", ["forward", "dkdv", "dq"])
def test_programs_with_the_same_kernel_share_an_instance(kind):
    """HF's explicit 1/√D scale and the default one; RoPE (from theta, or from HF's tables) and a norm before
    it, once a pass applies them, and plain causal attention: one instance each way."""
    causal = digest(verify.VARIANTS["causal"][0].graph(), kind)
    assert digest(hf_graph(scale=128**-0.5), kind) == causal
    assert digest(llama.graph(), kind, hoisted=True) == causal
    tables = torch.ones(1, 8, 128)
    assert digest(hf_graph(scale=128**-0.5, cos=tables, sin=tables), kind, hoisted=True) == causal
    weight = torch.ones(128)
    assert digest(qwen3.graph(wq=weight, wk=weight, cos=tables, sin=tables), kind, hoisted=True) == causal


@pytest.mark.parametrize("kind", ["forward", "dkdv", "dq"])
def test_different_code_is_a_different_instance(kind):
    window = verify.VARIANTS["sliding_window"][0]  # left=100
    other_window = af.attention(lambda q, k, v: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 101)) @ v)
    capped = {
        cap: af.attention(lambda q, k, v, c=cap: af.softmax(af.softcap(af.causal(af.scaled_dot_product(q, k)), c)) @ v)
        for cap in (20.0, 30.0)
    }
    digests = [
        digest(verify.VARIANTS["causal"][0].graph(), kind),
        digest(verify.VARIANTS["dense"][0].graph(), kind),
        digest(window.graph(), kind),
        digest(other_window.graph(), kind),
        *(digest(p.graph(), kind) for p in capped.values()),
    ]
    assert len(set(digests)) == len(digests)


SOURCE = '''"""A module."""
import triton.language as tl
from somewhere import helper


def leaf(x, unread, also_read, SIZE: tl.constexpr):
    """Reads x and also_read."""
    y = x + also_read  # a comment
    return tl.sum(y * SIZE, 0)


def middle(a, passed_on, b, SIZE: tl.constexpr):
    return leaf(a, passed_on, b, SIZE=SIZE) + helper(a, mask=b)


def top(p, q, r, s, SIZE: tl.constexpr):
    pairs = [(middle, (p, q, r, SIZE)), (leaf, (p, s, r, SIZE))]
    return middle(p, s, q, SIZE=SIZE) + len(pairs)
'''


def test_canonical_source_drops_names_docstrings_and_unread_parameters():
    canonical = canonical_source(SOURCE)
    tree = ast.parse(canonical)  # still Python
    functions = {f.name: [a.arg for a in f.args.args] for f in tree.body if isinstance(f, ast.FunctionDef)}
    # leaf(x, also_read, SIZE), middle(a, b, SIZE), top(p, q, r, SIZE): top's s reaches only unread parameters
    assert list(functions.values()) == [["_1", "_2", "_3"], ["_5", "_6", "_3"], ["_8", "_9", "_10", "_3"]]
    assert '"""' not in canonical and "comment" not in canonical and "unread" not in canonical
    for kept in ("tl.sum", "helper(_5, mask=_6)", "len(", "tl.constexpr", "from somewhere import helper"):
        assert kept in canonical, kept  # imports, builtins, attributes and others' keywords keep their names
    assert "_0(_5, _6, _3=_3)" in canonical  # leaf's call: the unread argument gone, its keyword renamed
    assert "(_4, (_8, _10, _3))" in canonical and "(_0, (_8, _10, _3))" in canonical  # (function, arguments)
    renamed = SOURCE.replace("leaf", "first").replace("passed_on", "dropped").replace("A module.", "Another.")
    assert canonical_source(renamed) == canonical
    assert canonical_source(SOURCE.replace("tl.sum(y * SIZE, 0)", "tl.sum(y * SIZE, 1)")) != canonical
