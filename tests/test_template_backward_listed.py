"""The dK/dV and dQ templates follow a mask's lists (block sparsity), checked with no GPU: that the dK/dV
instance's loader warp and consumers walk the same listed query tiles, head by head (``kernels/dkdv_listed.py``),
and the dQ instance's the same listed key blocks (``kernels/dq_listed.py``); that the listing mask's keep applies
only in the blocks its lists call partial; that a backward runs the instances only where the mask's block size
lets a program's keys (dK/dV) or rows (dQ) lie in one block; and that the GPU check has the cases. The instances'
resources are checked in tests/test_template_resources.py, their gradients on a GPU (tests/test_template_gpu.py).
"""

from __future__ import annotations

import ast
import re

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.kernels import capability, dkdv_keep, dkdv_listed, verify
from attnfuse.passes.codegen.loops import listing_mask
from attnfuse.passes.compiler import compile as compile_plan
from attnfuse.passes.compiler import lowered
from attnfuse.plan import KernelConfig
from attnfuse.runtime import backward as runtime_backward
from attnfuse.runtime import forward as runtime_forward
from attnfuse.runtime.compiled import compiled
from attnfuse.runtime.inputs import KVCache
from attnfuse.runtime.interpreter import InterpretedKernel
from attnfuse.runtime.source_cache import load_function, write_source

from test_template import _undefined
from test_template_listed import _assigned

LISTED = sorted(verify.LISTED_VARIANTS)
SM90 = KernelConfig(
    arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, group=2, save_lse=True, fp32_precision="ieee"
)


def _source(variant: str, head_dim: int = 128, kind: str = "dkdv") -> str:
    program, extra = verify.LISTED_VARIANTS[variant]
    config = attrs.evolve(SM90, head_dim=head_dim, head_dim_v=head_dim)
    return compile_plan(program.graph(**extra(4, 48, 64, "cpu")), config).templates.kernels[kind].source


def _function(source: str, suffix: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name.endswith(suffix))


def _walk(function: ast.FunctionDef) -> list[str]:
    """The statements of ``function`` that walk the steps: the lists' names, the steps' count, each step's head
    and rows (unparsed, in order)."""
    names = {"list_size", "list_tiles", "list_block", "n_steps", "h", "t_head", "n_head", "j", "start_m"}
    found = []
    for node in ast.walk(function):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if {ast.unparse(t) for t in targets} & names:
                found.append(ast.unparse(node))
        elif isinstance(node, (ast.For, ast.While)):
            found.append(ast.unparse(node.iter if isinstance(node, ast.For) else node.test))
    return found


@pytest.mark.parametrize("variant", LISTED)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_loader_walks_the_lists_and_hands_each_step_to_the_consumers(variant, head_dim):
    """The loader warp walks the column list of the program's key block (``q_num``/``q_idx``), head by head, and
    hands each step's head, first row and partial flag to the consumers with its tiles (``load_query_tile``);
    the consumers count the same steps from the same statements and take each step from the loader
    (``read_step``), following no list. The loader is the instance's own, not the contiguous ``dkdv_loader``, and
    the source is complete Gluon."""
    source = _source(variant, head_dim)
    loader, consumer = _function(source, "_loader"), _function(source, "_consumer")
    walk = _walk(loader)
    count = ("list_size =", "list_tiles =", "list_block =", "n_steps =", "for hh in range(heads)")
    counted = [ast.unparse(n) for n in consumer.body if ast.unparse(n).startswith(count)]
    loader_body = [ast.unparse(n) for n in loader.body]
    assert len(counted) == 5 and any(counted == loader_body[i : i + 5] for i in range(len(loader_body)))
    assert "n_steps +=" in counted[-1] and "_q_num" in counted[-1]
    start = [w for w in walk if w.startswith("start_m =")]
    assert len(start) == 1 and "_q_idx" in start[0] and "list_block" in start[0]
    assert "t - t_head >= n_head" in walk
    calls = [ast.unparse(n) for n in ast.walk(loader) if isinstance(n, ast.Call)]
    assert any(c.startswith("load_query_tile(") and "h, start_m, partial, t," in c for c in calls)
    steps = next(n for n in consumer.body if isinstance(n, ast.For) and ast.unparse(n.iter) == "range(n_steps)")
    text = ast.unparse(steps)
    assert "h, start_m, list_partial = read_step(step_info, stage)" in text and "_q_idx" not in text
    entry = _function(source, _function(source, "_consumer").name.removesuffix("_consumer"))
    called = {ast.unparse(n) for n in ast.walk(entry) if isinstance(n, ast.Name)}
    assert "dkdv_loader" not in called and loader.name in called
    assert _undefined(source) == []


@pytest.mark.parametrize("variant", LISTED)
def test_a_masked_listed_step_stores_its_keep_and_the_chain_reads_it(variant):
    """A listed step is masked where the other masks' facts say or its block is partial; a masked step first
    stores its keep in shared memory (rows below Nq, the other masks' keeps, the listing mask's only where its
    lists call the block partial), and its chain reads it there."""
    source = _source(variant)
    consumer = _function(source, "_consumer")
    assert "masked = (start_m < full_start) | (start_m >= full_end) | list_partial" in ast.unparse(consumer)
    ifs = [n for n in ast.walk(consumer) if isinstance(n, ast.If)]
    stores = [n for n in ifs if ast.unparse(n.test) == "masked" and "_keep(keep_tile, start_m" in ast.unparse(n)]
    assert len(stores) == 1 and "list_partial)" in ast.unparse(stores[0])
    chain = [ast.unparse(n) for n in ifs if ast.unparse(n.test) == "masked" and n not in stores]
    assert len(chain) == 1 and "keep = keep_tile.load(S_LAYOUT) != 0" in chain[0] and "_active" not in chain[0]
    keep = ast.unparse(_function(source, "_keep"))
    assert "keep_tile.slice(part * BLOCK_M, BLOCK_M).store" in keep and "q_ok[:, None] &" in keep
    assert re.search(r"\(tl\.load\(block_sparse_\d+_active.*\| \(list_partial == 0\)\)", keep)
    assert ("k_pos[None, :] <= q_pos[:, None]" in keep) == (variant == "block_sparse_tokens")  # its causal mask


@pytest.mark.parametrize("variant", LISTED)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_dq_loader_and_the_consumers_visit_the_same_listed_keys(variant, head_dim):
    """The dQ instance's loader warp brings step j's keys from its rows' list (``kv_num``/``kv_idx``) as its
    consumers compute them, with the kernel's step count; its own loader, not the contiguous ``dq_loader``."""
    source = _source(variant, head_dim, "dq")
    loader, consumer = _function(source, "_loader"), _function(source, "_consumer")
    for name in ("list_size", "list_tiles", "list_block", "start_n"):
        assert _assigned(loader, name) == _assigned(consumer, name) and len(_assigned(loader, name)) == 1
    assert "_kv_idx" in _assigned(consumer, "start_n")[0]
    entry = _function(source, consumer.name.removesuffix("_consumer"))
    assert any("_kv_num" in n for n in _assigned(entry, "n_steps"))
    called = {ast.unparse(n) for n in ast.walk(entry) if isinstance(n, ast.Name)}
    assert "dq_loader" not in called and loader.name in called
    assert _undefined(source) == []


@pytest.mark.parametrize("variant", LISTED)
def test_the_dq_instance_applies_the_listing_keep_only_in_partial_blocks(variant):
    consumer = ast.unparse(_function(_source(variant, kind="dq"), "_consumer"))
    ifs = [n for n in ast.walk(ast.parse(consumer)) if isinstance(n, ast.If)]
    masked = next(ast.unparse(n) for n in ifs if ast.unparse(n.test) == "masked")
    partial = next(ast.unparse(n) for n in ifs if ast.unparse(n.test) == "list_partial")
    assert "_active" not in masked and "_active" in partial and "ds = tl.where(" in partial
    assert ("k_pos[None, :] <= q_pos[:, None]" in masked) == (variant == "block_sparse_tokens")  # its causal mask


class _Template:
    """Stands for a chosen backward instance: records its launches (its outputs left as allocated)."""

    def __init__(self):
        self.launches = []

    def fits(self, *tensors):
        return True

    def __call__(self, *tensors_and_plugin_args):
        self.launches.append(tensors_and_plugin_args[-1])


@pytest.mark.parametrize("kind", ["dkdv", "dq"])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_a_backward_runs_a_template_only_with_a_block_size_it_follows(kind, block_size, monkeypatch):
    """Where a backward template's instance is chosen, a backward whose block lists' block size it does not
    follow runs the generated kernels (dq, dk and dv checked against the float64 reference's gradients); one
    whose block size it follows runs the instance."""
    torch.manual_seed(block_size)
    template = _Template()
    monkeypatch.setattr(runtime_backward, f"template_{kind}", lambda plan: template)

    @af.attention
    def sparse(q, k, v, block_mask):
        return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v

    B, H, N, D = 1, 2, 40, 16
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64) for _ in range(3))
    active = torch.rand(1, H, -(-N // block_size), -(-N // block_size)) < 0.7
    mask = af.BlockMask.from_blocks(active, N, N, block_size=block_size)
    config = KernelConfig(
        arch="interpreter", dtype="float64", head_dim=D, head_dim_v=D, group=1, save_lse=True, fp32_precision="ieee"
    )
    plan = compiled(sparse.graph(block_mask=mask), config).plan
    inputs, kv = {"block_mask": mask}, KVCache(k, v, N)
    out, lse = runtime_forward.ForwardKernel(plan)(q, kv, inputs)
    dout = torch.randn_like(out)
    dq, dk, dv, _ = runtime_backward.BackwardKernels(plan, ())(q, kv, out, lse, dout, None, inputs)
    follows = capability.block_list_reason(block_size) is None
    assert len(template.launches) == int(follows) and follows == (block_size % 128 == 0)
    if not follows:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = torch.autograd.grad(sparse.reference(*leaves, mask), leaves, dout)
        for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
            torch.testing.assert_close(got, w, atol=1e-9, rtol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


def test_the_gpu_check_has_the_listed_backward_cases():
    cases = [c for c in verify.backward_cases() if c.variant in verify.LISTED_VARIANTS]
    assert {(c.kind, c.variant, c.head_dim, c.dtype) for c in cases} == {
        (kind, v, d, t) for kind in ("dkdv", "dq") for v in LISTED for d in (64, 128) for t in verify.DTYPES
    }
    assert any(c.shape[1] > c.shape[2] for c in cases) and any(c.shape[4] % 128 for c in cases)  # GQA, ragged keys


def _walked(mask: af.BlockMask, b: int, h0: int, heads: int, n0: int) -> tuple[list[tuple[int, int]], int]:
    """The steps the dK/dV instance's walk (``dkdv_listed.walk``, the loader's text) takes for
    the keys n0.. of (batch b, query heads h0..h0+heads), run by Triton's interpreter on ``mask``'s lists: each
    step's (head, first row), and the steps' count."""
    program, _ = verify.LISTED_VARIANTS["block_sparse"]
    graph = program.graph(block_mask=mask)
    config = attrs.evolve(SM90, head_dim=64, head_dim_v=64, group=1)
    kernel = lowered(graph, config)
    m = listing_mask(kernel)
    walk = dkdv_listed.walk(m)
    names = dkdv_keep.reads(kernel, walk)
    body = "".join(f"    {line}\n" for line in walk.splitlines())
    source = (
        "import triton.language as tl\n\n\n"
        f"def walked(Out, n0, h0, heads, b, {', '.join(names)}, BLOCK_M: tl.constexpr):\n{body}"
        "        tl.store(Out + 1 + 2 * t, h)\n"
        "        tl.store(Out + 2 + 2 * t, start_m)\n"
        "    tl.store(Out, n_steps)\n"
    )
    fn = load_function(source, "walked", write_source("walked", source))
    B, H = mask.active.shape[:2]
    q = torch.zeros(B, H, mask.Nq, 64)
    kv = KVCache(torch.zeros(B, H, mask.Nk, 64), torch.zeros(B, H, mask.Nk, 64), mask.Nk)
    prepared = compiled(graph, attrs.evolve(config, arch="interpreter", dtype="float32")).forward.plugin_args(
        q, kv, {"block_mask": mask}
    )
    values = []
    for name in names:
        base, _, axis = name.rpartition("_s")
        values.append(prepared.args[base].stride(int(axis)) if base in prepared.args else prepared.args[name])
    out = torch.full((1 + 2 * 64,), -1, dtype=torch.int32)
    InterpretedKernel(fn).launch((1,), (out, n0, h0, heads, b, *values), {"BLOCK_M": 64})
    steps = int(out[0])
    return [(int(out[1 + 2 * t]), int(out[2 + 2 * t])) for t in range(steps)], steps


@pytest.mark.parametrize("block_size", [128, 256])
def test_the_dkdv_walk_visits_each_listed_query_tile_of_each_head_once(block_size):
    """Run on the interpreter, the walk of a program's keys visits, head by head, exactly the 64-row tiles of the
    query blocks its key block keeps (read from the mask's grid, not its lists), each once: heads whose list is
    empty (the first, one between, the last) are skipped, and its steps' count is theirs."""
    torch.manual_seed(block_size)
    B, H, N = 2, 6, 600
    blocks = -(-N // block_size)
    active = torch.rand(B, H, blocks, blocks) < 0.5
    kb = 1
    active[:, [0, 2, H - 1], :, kb] = False  # empty column lists: the first head, one between, the last
    active[:, 1, :, kb] = True
    mask = af.BlockMask.from_blocks(active, N, N, block_size=block_size)
    for b in range(B):
        for h0, heads in ((0, H), (1, 2), (2, 1)):
            walked, steps = _walked(mask, b, h0, heads, n0=kb * block_size)
            want = [
                (h, qb * block_size + t * 64)
                for h in range(h0, h0 + heads)
                for qb in range(blocks)
                if active[b, h, qb, kb]
                for t in range(block_size // 64)
            ]
            assert steps == len(walked) == len(want)
            assert sorted(walked) == sorted(want) and len(set(walked)) == len(walked)
            assert [h for h, _ in walked] == sorted(h for h, _ in walked)  # head by head
