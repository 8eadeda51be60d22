"""The template instances compiled for sm90 here, with no GPU (Triton, ptxas, nvdisasm:
``attnfuse/kernels/resources.py``): every variant of ``verify.VARIANTS`` is served by the forward template and the
dK/dV and dQ templates (the listed ones, ``verify.LISTED_VARIANTS``, too) and compiles within a block's shared
memory, on wgmma and TMA, with one main loop per consumer warpgroup; so do the forward instances of calls with a
fact (``FACT_CASES``: kv_lens, given positions, packed sequences; float8 ones too), and the dK/dV and dQ instances
of packed calls (``PACKED_DKDV_CASES``, ``PACKED_DQ_CASES``). Each spills nothing, in its main path or in the
forward's careful redo, but where ``KNOWN_SPILLS`` and ``KNOWN_CAREFUL_SPILLS`` say it does today (exactly that);
its main loop (the forward's key loop, the dK/dV and dQ step loops) holds no local memory but where
``KNOWN_LOOP_SPILLS`` says it does.

Each case is one compile (seconds). Forward: bfloat16 at every head dim, float8 (e4m3) at its head dims for
``verify.FP8_VARIANTS`` (the listed ones too). dK/dV and dQ: bfloat16 at their head dims. The instances with
attention dropout (``verify.DROPOUT_VARIANTS``, the head dims the templates take it at) likewise. A float16 instance
is its bfloat16 one with the other 16-bit operand type, and compiles to the same registers, spills and loops
(docs/benchmarks.md's table has both): float16 is compiled for causal at head dim 128 (forward, with and without
dropout, and dQ) and in packed calls, the witnesses that it still does. The cases share no state (each
compiles in its own temporary directory), so pytest-xdist spreads them over its workers."""

import pytest

from attnfuse.errors import InputError
from attnfuse.kernels import verify
from attnfuse.kernels.capability import FORWARD_DROPOUT_HEAD_DIMS, FORWARD_FP8_HEAD_DIMS
from attnfuse.kernels.resources import GROUP_SUMS, template_resources, variant_plan
from attnfuse.kernels.tiles import SHARED_MEMORY_LIMIT

CASES = [(v, d, "bfloat16", False) for v in verify.FORWARD_VARIANTS for d in verify.HEAD_DIMS]
CASES += [("causal", 128, "float16", False), ("causal", 128, "float16", True)]
CASES += [(v, d, "bfloat16", True) for v in verify.DROPOUT_VARIANTS for d in FORWARD_DROPOUT_HEAD_DIMS]
CASES += [(v, d, "float8_e4m3fn", False) for v in verify.FP8_VARIANTS for d in FORWARD_FP8_HEAD_DIMS]
CASES += [("causal", d, "float8_e5m2", False) for d in FORWARD_FP8_HEAD_DIMS]  # the same instance, e5m2 tiles
DKDV_CASES = [(v, d, "bfloat16", False) for v in verify.FORWARD_VARIANTS for d in verify.DKDV_HEAD_DIMS]
DKDV_CASES += [(v, d, "bfloat16", True) for v in verify.DROPOUT_VARIANTS for d in verify.DKDV_HEAD_DIMS]
DQ_CASES = [(v, d, "bfloat16", False) for v in verify.FORWARD_VARIANTS for d in verify.DKDV_HEAD_DIMS]
DQ_CASES += [("causal", 128, "float16", False)]
DQ_CASES += [(v, d, "bfloat16", True) for v in verify.DROPOUT_VARIANTS for d in verify.DKDV_HEAD_DIMS]
# Instances of calls with a fact (``verify.fact_cases``): each fact at head dims 64 to 256, with a window's two
# masked ends, a hoisted transform's rows, a normaliser with sinks, a bias read at packed rows
FACT_CASES = [
    ("causal", 128, "bfloat16", "kv_lens"),
    ("sliding_window", 256, "bfloat16", "kv_lens"),
    ("causal", 128, "bfloat16", "positions"),
    ("rope_causal", 64, "bfloat16", "positions"),
    ("causal", 128, "bfloat16", "varlen"),
    ("sinks", 64, "float16", "varlen"),
    ("sliding_window", 256, "bfloat16", "varlen"),
    ("additive_bias", 128, "bfloat16", "varlen"),
    ("additive_bias", 256, "bfloat16", "varlen"),
    ("causal", 128, "float8_e4m3fn", "kv_lens"),
    ("sliding_window", 64, "float8_e4m3fn", "positions"),
    ("causal", 128, "float8_e4m3fn", "varlen"),
    ("sinks", 64, "float8_e5m2", "varlen"),
]
# The backward instances of packed calls (``verify.backward_cases``, fact "varlen"): masked at both head dims, sinks
PACKED_BACKWARD_CASES = [("causal", 128, "bfloat16"), ("sinks", 64, "float16"), ("sliding_window", 128, "bfloat16")]
# and of a packed call reading a tensor at packed rows (an additive bias): where the dK/dV template takes one, and the
# dQ template's
PACKED_DKDV_CASES = [*PACKED_BACKWARD_CASES, ("additive_bias", 64, "float16"), ("additive_bias", 128, "bfloat16")]
PACKED_DQ_CASES = [*PACKED_BACKWARD_CASES, ("additive_bias", 128, "bfloat16")]
CONSUMERS = 2  # consumer warpgroups of either template, each running its own key (forward) or step (dK/dV) loop

# A KNOWN DEFECT, to be driven to zero: the instances that spill today (ptxas' spill stores of the main path, in
# bytes, per (kernel, whose, head dim, dtype)), listed in docs/benchmarks.md's "Template resources"; every other
# instance spills nothing. A ratchet: an instance may spill less, never more, and one that spills less is listed
# with its new figure. All of them spill outside their main loop, but those of ``KNOWN_LOOP_SPILLS``.
KNOWN_SPILLS = {
    ("forward", "dense", 128, "float8_e4m3fn"): 4,
    ("forward", "causal_alibi", 128, "float8_e4m3fn"): 4,
    ("forward", "block_sparse", 64, "float8_e4m3fn"): 8,
    ("forward", "block_sparse_tokens", 64, "float8_e4m3fn"): 4,
    ("forward", "causal with kv_lens", 128, "bfloat16"): 8,
    ("forward", "causal with varlen", 128, "bfloat16"): 48,
    ("forward", "causal with kv_lens", 128, "float8_e4m3fn"): 8,
    ("forward", "causal with varlen", 128, "float8_e4m3fn"): 12,
    ("dkdv", "softcap+dropout", 128, "bfloat16"): 36,
}
# and those that hold local memory in their main loop: with attention dropout, its mask regenerated into shared
# memory, softcap's kept input on top
KNOWN_LOOP_SPILLS = {("dkdv", "softcap+dropout", 128, "bfloat16")}
# and those that spill in their careful redo (a noinline function, run for a block whose out is not finite): with
# float8 at head dim 64, a token block mask's redo keeps one or two registers in local memory around its key loop
KNOWN_CAREFUL_SPILLS = {("block_sparse_tokens", 64, "float8_e4m3fn"): 12}


def _ids(cases) -> list[str]:
    return [f"{v}{'+dropout' if dropout else ''}-D{d}-{t}" for v, d, t, dropout in cases]


def _problems(used) -> list[str]:
    """What a compiled instance of either template gets wrong, every one of them (so a failure names them all)."""
    problems = []
    if used.shared_bytes > SHARED_MEMORY_LIMIT:
        problems.append(f"{used.shared_bytes} bytes of shared memory, above {SHARED_MEMORY_LIMIT}")
    if not (used.wgmma > 0 and used.tma > 0):
        problems.append(f"{used.wgmma} wgmma and {used.tma} TMA instructions in the SASS")
    if used.loops != CONSUMERS:
        problems.append(f"{used.loops} main loops with wgmma found, not one per consumer warpgroup ({CONSUMERS})")
    return problems


def _check_forward(plan, what: str, dtype: str, head_dim: int) -> None:
    """``plan``'s forward instance (``what``: whose) is on the template, compiles for sm90, spills nothing in its
    careful redo and nothing in its main path (or what ``KNOWN_SPILLS`` says)."""
    spec = plan.templates.kernels.get("forward")
    if spec is None:
        pytest.fail(f"{what} falls off the forward template: {plan.templates.reasons['forward']}")
    used = template_resources(spec, dtype, head_dim, plan.config.save_lse)
    problems = _problems(used) + _ratchet(used, ("forward", what, head_dim, dtype), "key")
    careful = KNOWN_CAREFUL_SPILLS.get((what, head_dim, dtype), 0)
    if used.careful_spill_bytes > careful:
        problems.append(f"{used.careful_spill_bytes} bytes spilled in the careful redo (today's: {careful})")
    elif careful and used.careful_spill_bytes < careful:
        problems.append(f"{used.careful_spill_bytes} bytes spilled in the careful redo: lower KNOWN_CAREFUL_SPILLS")
    assert not problems, f"{spec.name}: " + "; ".join(problems) + f"\n{used}"


def _ratchet(used, key: tuple, loop: str) -> list[str]:
    """What an instance's spills get wrong against ``KNOWN_SPILLS`` and ``KNOWN_LOOP_SPILLS`` (``key``: its
    (kernel, whose, head dim, dtype); ``loop``: its main loop's name)."""
    problems, known = [], KNOWN_SPILLS.get(key, 0)
    if used.loop_local_memory and key not in KNOWN_LOOP_SPILLS:
        problems.append(
            f"local memory (STL/LDL) in the {loop} loop ({used.spill_bytes} bytes spilled in the main path)"
        )
    elif not used.loop_local_memory and key in KNOWN_LOOP_SPILLS:
        problems.append(f"no local memory in the {loop} loop any more: take it out of KNOWN_LOOP_SPILLS and the docs")
    if used.spill_bytes > known:
        problems.append(f"{used.spill_bytes} bytes spilled in the main path, above today's {known} (a ratchet)")
    elif used.spill_bytes < known:
        problems.append(f"{used.spill_bytes} bytes spilled in the main path, below today's {known}: lower KNOWN_SPILLS")
    return problems


@pytest.mark.parametrize("variant,head_dim,dtype,dropout", CASES, ids=_ids(CASES))
def test_instance_compiles_for_sm90_and_spills_nothing(variant, head_dim, dtype, dropout):
    what = f"{variant}+dropout" if dropout else variant
    _check_forward(variant_plan(variant, dtype, head_dim, dropout=dropout), what, dtype, head_dim)


@pytest.mark.parametrize(
    "variant,head_dim,dtype,fact", FACT_CASES, ids=[f"{v}-D{d}-{t}-{f}" for v, d, t, f in FACT_CASES]
)
def test_instance_of_a_call_with_a_fact_compiles_for_sm90_and_spills_nothing(variant, head_dim, dtype, fact):
    _check_forward(variant_plan(variant, dtype, head_dim, fact), f"{variant} with {fact}", dtype, head_dim)


def _check_dkdv(plan, what: str, dtype: str, head_dim: int) -> None:
    """``plan``'s dK/dV instance (``what``: whose) is on the template, compiles for sm90 and spills nothing (or what
    ``KNOWN_SPILLS`` says)."""
    spec = plan.templates.kernels.get("dkdv")
    if spec is None:
        pytest.fail(f"{what} falls off the dK/dV template: {plan.templates.reasons['dkdv']}")
    used = template_resources(spec, dtype, head_dim, plan.config.save_lse)
    problems = _problems(used) + _ratchet(used, ("dkdv", what, head_dim, dtype), "step")
    assert not problems, f"{spec.name}: " + "; ".join(problems) + f"\n{used}"


@pytest.mark.parametrize("variant,head_dim,dtype,dropout", DKDV_CASES, ids=_ids(DKDV_CASES))
def test_dkdv_instance_compiles_for_sm90_and_spills_nothing(variant, head_dim, dtype, dropout):
    plan = variant_plan(variant, dtype, head_dim, dropout=dropout)  # the training plan: it saves the lse
    _check_dkdv(plan, f"{variant}+dropout" if dropout else variant, dtype, head_dim)


@pytest.mark.parametrize(
    "variant,head_dim,dtype", PACKED_DKDV_CASES, ids=[f"{v}-D{d}-{t}" for v, d, t in PACKED_DKDV_CASES]
)
def test_dkdv_instance_of_a_packed_call_compiles_for_sm90_and_spills_nothing(variant, head_dim, dtype):
    _check_dkdv(variant_plan(variant, dtype, head_dim, "varlen"), f"{variant} packed", dtype, head_dim)


def _check_dq(plan, what: str, dtype: str, head_dim: int) -> None:
    """``plan``'s dQ instance (``what``: whose) is on the template, compiles for sm90 and spills nothing."""
    spec = plan.templates.kernels.get("dq")
    if spec is None:
        pytest.fail(f"{what} falls off the dQ template: {plan.templates.reasons['dq']}")
    used = template_resources(spec, dtype, head_dim, plan.config.save_lse)
    problems = _problems(used) + _ratchet(used, ("dq", what, head_dim, dtype), "step")
    assert not problems, f"{spec.name}: " + "; ".join(problems) + f"\n{used}"


@pytest.mark.parametrize("variant,head_dim,dtype,dropout", DQ_CASES, ids=_ids(DQ_CASES))
def test_dq_instance_compiles_for_sm90_and_spills_nothing(variant, head_dim, dtype, dropout):
    plan = variant_plan(variant, dtype, head_dim, dropout=dropout)  # the training plan: it saves the lse dQ reads
    _check_dq(plan, f"{variant}+dropout" if dropout else variant, dtype, head_dim)


@pytest.mark.parametrize(
    "variant,head_dim,dtype", PACKED_DQ_CASES, ids=[f"{v}-D{d}-{t}" for v, d, t in PACKED_DQ_CASES]
)
def test_dq_instance_of_a_packed_call_compiles_for_sm90_and_spills_nothing(variant, head_dim, dtype):
    _check_dq(variant_plan(variant, dtype, head_dim, "varlen"), f"{variant} packed", dtype, head_dim)


@pytest.mark.parametrize("group_sum", [g for g in GROUP_SUMS if g != "none"])
def test_dkdv_instance_compiles_for_a_split_gqa_group(group_sum):
    plan = variant_plan("dense", "bfloat16", 64)
    used = template_resources(plan.templates.kernels["dkdv"], "bfloat16", 64, True, group_sum=group_sum)
    assert not _problems(used) and not used.spill_bytes, used


def test_a_group_sum_the_dkdv_template_does_not_know_is_refused():
    spec = variant_plan("dense", "bfloat16", 64).templates.kernels["dkdv"]
    with pytest.raises(InputError, match=r"group_sum='sum': the dK/dV template sums a group as one of"):
        template_resources(spec, "bfloat16", 64, True, group_sum="sum")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bf16"])
def test_a_dtype_the_templates_do_not_compile_for_is_refused(dtype):
    spec = variant_plan("dense", "bfloat16", 64).templates.kernels["forward"]
    with pytest.raises(InputError, match=rf"dtype='{dtype}': the templates compile for float16 and bfloat16, and"):
        template_resources(spec, dtype, 64, save_lse=True)


def test_float8_compiles_for_the_forward_template_only():
    spec = variant_plan("dense", "bfloat16", 64).templates.kernels["dkdv"]
    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        with pytest.raises(InputError, match=rf"dtype='{dtype}': .*template for float8_e4m3fn, float8_e5m2 too"):
            template_resources(spec, dtype, 64, save_lse=True)
