"""The forward template follows a mask's block lists (block sparsity), checked with no GPU: which listed programs
and calls it serves (``capability``, ``runtime/forward.py``), that its instance visits the listed key blocks the
way the generated kernels do (``kernels/listed.py``), and that the GPU check's listed cases cover what they must
(empty lists, full and partial blocks, GQA, ragged lengths). The numbers come from ``tests/test_template_gpu.py``."""

from __future__ import annotations

import ast
import re

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.kernels import capability, verify
from attnfuse.passes.codegen.loops import listing_mask
from attnfuse.passes.compiler import compile as compile_plan
from attnfuse.passes.compiler import lowered
from attnfuse.plan import KernelConfig
from attnfuse.runtime import forward as runtime_forward
from attnfuse.runtime.compiled import compiled
from attnfuse.runtime.inputs import KVCache

SM90 = KernelConfig(
    arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, group=2, save_lse=True, fp32_precision="ieee"
)
LISTED = sorted(verify.LISTED_VARIANTS)


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


def _graph(variant: str):
    program, extra = verify.LISTED_VARIANTS[variant]
    return program.graph(**extra(4, 48, 64, "cpu"))


def _spec(variant: str, **changes):
    return compile_plan(_graph(variant), attrs.evolve(SM90, **changes)).templates.kernels["forward"]


@pytest.mark.parametrize("variant", LISTED)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_templates_serve_listed_programs(variant, dtype, head_dim):
    config = attrs.evolve(SM90, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim)
    kernel = lowered(_graph(variant), config)
    assert capability.forward_reason(kernel) is None
    templates = compile_plan(_graph(variant), config).templates
    assert "forward" in templates.kernels
    if head_dim in (64, 128):  # the backward templates' head dims
        assert capability.dkdv_reason(kernel) is None and "dkdv" in templates.kernels
        assert capability.dq_reason(kernel) is None and "dq" in templates.kernels


@pytest.mark.parametrize("variant", LISTED)
@pytest.mark.parametrize(
    "fact, words",
    [
        ("kv_lens", "lists its blocks, .* per-sequence key counts \\(kv_lens\\)"),
        ("positions", "lists its blocks, .* given positions"),
    ],
)
def test_the_forward_template_refuses_block_lists_in_a_call_with_a_fact(variant, fact, words):
    """A listed program's loader, steps and careful redo take none of a call's facts (``forward_facts``): a call
    with kv_lens or given positions and a listing mask runs the generated kernel, and the reason names both. The
    GPU check has no such case."""
    kernel = lowered(_graph(variant), attrs.evolve(SM90, **{fact: True}))
    reason = capability.forward_reason(kernel)
    assert reason is not None and re.search(words, reason), reason
    assert "forward" not in compile_plan(_graph(variant), attrs.evolve(SM90, **{fact: True})).templates.kernels
    assert not [c for c in verify.fact_cases() if c.variant in verify.LISTED_VARIANTS]


@pytest.mark.parametrize("variant", LISTED)
def test_in_a_packed_call_a_block_mask_is_an_element_mask_the_templates_take(variant):
    """In a packed call a block mask lists nothing: its keep reads its grid at packed rows, element by element
    (``passes/lower.py``), and the templates take it as any mask reading a tensor at packed rows (the forward and
    dQ templates; the dK/dV one not yet). The GPU check has no such case, so those instances stay opt-in
    (``ATTNFUSE_TEMPLATES=all``)."""
    kernel = lowered(_graph(variant), attrs.evolve(SM90, varlen=True))
    assert listing_mask(kernel) is None and "q_start + q_idx" in "\n".join(m.fragment.keep for m in kernel.masks)
    assert capability.forward_reason(kernel) is None and capability.dq_reason(kernel) is None
    assert "reads q_idx or k_idx" in capability.dkdv_reason(kernel)
    assert not [
        c for c in verify.fact_cases() + verify.backward_cases() if c.variant in verify.LISTED_VARIANTS and c.fact
    ]


@pytest.mark.parametrize("variant", LISTED)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_templates_refuse_block_lists_in_a_call_with_dropout(variant, head_dim):
    """Dropout and block lists, each of which the forward and dK/dV templates take alone, are not combined in them
    yet: such a call runs the generated kernels, and the reasons name both."""
    config = attrs.evolve(SM90, head_dim=head_dim, head_dim_v=head_dim)
    dropped = lowered(_graph(variant), attrs.evolve(config, dropout=True))
    for kind, reason in (("forward", capability.forward_reason(dropped)), ("dkdv", capability.dkdv_reason(dropped))):
        assert reason is not None and "lists its blocks" in reason and "attention dropout (dropout_p)" in reason
        assert kind not in compile_plan(_graph(variant), attrs.evolve(config, dropout=True)).templates.kernels
    assert capability.forward_reason(lowered(_graph(variant), config)) is None
    assert capability.dkdv_reason(lowered(_graph(variant), config)) is None


def _function(source: str, suffix: str) -> ast.FunctionDef:
    """The function of ``source`` whose name ends in ``suffix``."""
    return next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name.endswith(suffix))


def _assigned(function: ast.FunctionDef, name: str) -> list[str]:
    """The right-hand sides ``name`` is assigned in ``function``, in order."""
    return [
        ast.unparse(n.value)
        for n in ast.walk(function)
        if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [name]
    ]


@pytest.mark.parametrize("variant", LISTED)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_the_loader_and_the_consumers_visit_the_same_listed_keys(variant, head_dim):
    """The loader warp brings step j's keys from the list as the consumers compute them (the same expression
    of j), with the list's block size and block of rows; the program's own loader, not the contiguous one."""
    spec = _spec(variant, head_dim=head_dim, head_dim_v=head_dim)
    source = spec.source
    loader, consumer = _function(source, "_loader"), _function(source, "_consumer")
    for name in ("list_size", "list_tiles", "list_block"):
        assert _assigned(loader, name) == _assigned(consumer, name) and len(_assigned(loader, name)) == 1
    keys = _assigned(consumer, "start_n")
    assert _assigned(loader, "start_n") == [keys[1]] and keys[0] == keys[1].replace("j", "0")
    assert "kv_idx" in keys[1] and "list_block" in keys[1]
    entry = _function(source, spec.name)
    called = [ast.unparse(n) for n in ast.walk(entry) if isinstance(n, ast.Name)]
    assert "forward_loader" not in called and loader.name in called


@pytest.mark.parametrize("variant", LISTED)
def test_the_listing_mask_applies_its_keep_only_in_the_blocks_its_lists_call_partial(variant):
    """As in the generated kernels: the listing mask's keep is implied in a listed block (never under the
    consumers' ``if masked:``), applied in a partial one (``if list_partial:``), and the careful redo's keep
    holds it where the block is partial."""
    source = _spec(variant).source
    consumer, careful = ast.unparse(_function(source, "_consumer")), ast.unparse(_function(source, "_columns"))
    masked = re.search(r"if masked:\n(.*?)\n(?=\s*(?:if list_partial|acc_rows))", consumer, re.S)
    assert masked is not None and "block_sparse" not in masked.group(1)
    assert re.search(r"if list_partial:\n\s+s = tl\.where\(\(tl\.load\(block_sparse_\d+_active", consumer)
    assert re.search(r"\| \(list_partial == 0\)\)\n", careful)
    assert re.search(r"for list_t in range\(0, tl\.load\(block_sparse_\d+_kv_num", careful)


@pytest.mark.parametrize("block_size", [128, 256, 512, 1024, 384])
def test_block_lists_of_multiples_of_a_programs_rows_are_followed(block_size):
    assert capability.block_list_reason(block_size) is None
    assert capability.block_list_reason(None) is None


@pytest.mark.parametrize("block_size", [16, 32, 64, 96, 192, 0, -128])
def test_other_block_sizes_are_refused_with_the_reason(block_size):
    reason = capability.block_list_reason(block_size)
    assert reason is not None and f"not {block_size}" in reason and "multiple of 128" in reason


class _Template:
    """Stands for a chosen forward instance: records its launches (out is left as allocated)."""

    def __init__(self):
        self.launches = []

    def fits(self, *tensors):
        return True

    def __call__(self, q, k, v, out, lse, plugin_args):
        self.launches.append(plugin_args)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_a_call_runs_the_template_only_with_a_block_size_it_follows(block_size, monkeypatch):
    """Where the template is chosen, a call whose block lists' block size it does not follow runs the generated
    kernel (its out checked against the float64 reference); one whose block size it follows runs the template."""
    template = _Template()
    monkeypatch.setattr(runtime_forward, "template_forward", lambda plan: template)
    B, H, N, D = 1, 2, 40, 16
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    active = torch.rand(1, H, -(-N // block_size), -(-N // block_size)) < 0.7
    mask = af.BlockMask.from_blocks(active, N, N, block_size=block_size)
    config = KernelConfig(
        arch="interpreter", dtype="float32", head_dim=D, head_dim_v=D, group=1, save_lse=False, fp32_precision="ieee"
    )
    kernel = runtime_forward.ForwardKernel(compiled(sparse.graph(block_mask=mask), config).plan)
    out, _ = kernel(q, KVCache(k, v, N), {"block_mask": mask})
    follows = block_size % 128 == 0
    assert len(template.launches) == int(follows)
    if not follows:
        ref = sparse.reference(q, k, v, mask)
        af.testing.assert_matches_reference(out, ref, sparse.reference(q, k, v, mask, dtype=q.dtype), q.dtype)


def test_the_listed_cases_cover_empty_lists_full_and_partial_blocks_gqa_and_ragged_lengths():
    listed = [c for c in verify.cases() if c.variant in verify.LISTED_VARIANTS]
    assert {(c.variant, c.head_dim, c.dtype) for c in listed if not c.poison} == {
        (v, d, t) for v in LISTED for d in verify.HEAD_DIMS for t in verify.DTYPES
    } | {(v, d, t) for v in LISTED for d in capability.FORWARD_FP8_HEAD_DIMS for t in verify.FP8_DTYPES}
    assert {c.variant for c in listed if c.poison} == set(LISTED)  # NaN values under and inside the lists
    assert any(c.shape[1] > c.shape[2] for c in listed)
    empty = partial = full = ragged = 0
    for c in listed:
        _, Hq, _, Nq, Nk = c.shape
        mask = verify.LISTED_VARIANTS[c.variant][1](Hq, Nq, Nk, "cpu")["block_mask"]
        assert mask.block_size % 128 == 0 and capability.block_list_reason(mask.block_size) is None
        empty += int((mask.kv_num_blocks == 0).sum())
        listed_blocks = mask.active.expand(1, Hq, *mask.active.shape[2:])
        partial_index = mask.partial_index.expand_as(listed_blocks)
        partial += int((listed_blocks & (partial_index >= 0)).sum())
        full += int((listed_blocks & (partial_index < 0)).sum())
        ragged += int(Nk % mask.block_size != 0 and bool(listed_blocks[..., -1].any()))
    assert empty and partial and full and ragged


@pytest.mark.parametrize("variant", LISTED)
def test_the_listed_cases_inputs_run_the_generated_kernel_as_the_reference_says(variant):
    """The cases' programs and masks, at a small shape through the generated kernels: valid inputs, and the
    reference the GPU check compares the template with."""
    program, extra = verify.LISTED_VARIANTS[variant]
    Hq, Hkv, Nq, Nk = 4, 2, 40, 56
    q = torch.randn(1, Hq, Nq, 16)
    k, v = (torch.randn(1, Hkv, Nk, 16) for _ in range(2))
    kwargs = extra(Hq, Nq, Nk, "cpu")
    ref = program.reference(q, k, v, **kwargs)
    low = program.reference(q, k, v, dtype=q.dtype, **kwargs)
    af.testing.assert_matches_reference(program(q, k, v, **kwargs), ref, low, q.dtype)
