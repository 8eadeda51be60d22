"""The compiler's Plan: every kernel's launch spec is the parameter list of its ``def`` line, and binding
checks argument names."""

import ast

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.launch_spec import CONSTEXPR
from attnfuse.passes.compiler import compile as compile_plan, lowered as lowered_of
from attnfuse.plan import KERNEL_KINDS, KernelConfig


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


@af.attention
def alibi_window(q, k, v):
    return af.softmax(af.alibi(af.sliding_window(af.scaled_dot_product(q, k), 20, 5))) @ v


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v


BASE = KernelConfig(
    arch="interpreter", dtype="float32", head_dim=32, head_dim_v=32, group=1, save_lse=True, fp32_precision="ieee"
)
CONFIGS = [
    BASE,
    attrs.evolve(BASE, group=2, wide_offsets=True),
    attrs.evolve(BASE, kv_lens=True, paged=True),
    attrs.evolve(BASE, dtype="float64", head_dim=24, q_transformed=True, k_transformed=True),
]


NAME_PARTS = {"forward": "fwd", "transform": "transformpass", "gradient": "gradpass"}


def _graph(program):
    """The program's graph (a runtime input's value does not matter to the trace)."""
    return program.graph(*(torch.empty(0) for _ in program._extra))


def _def_line(source: str, name: str) -> list[tuple[str, bool]]:
    """The parameters of function ``name`` in ``source``: (name, annotated tl.constexpr)."""
    [fn] = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == name]
    return [(a.arg, a.annotation is not None and ast.unparse(a.annotation) == "tl.constexpr") for a in fn.args.args]


def _specs(plan):
    grads = tuple(g for g in plan.input_gradients if g.prefix is not None)
    return [*plan.kernels.values(), plan.dq(grads)]


@pytest.mark.parametrize("program", [llama, alibi_window, sparse, biased], ids=lambda p: p.fn.__name__)
@pytest.mark.parametrize("config", CONFIGS, ids=["plain", "gqa-wide", "paged", "float64-transformed"])
def test_launch_spec_is_the_def_line(program, config):
    plan = compile_plan(_graph(program), config)
    kinds = {s.kind for s in _specs(plan)}
    assert kinds >= {"forward", "decode", "dkdv", "dq"}
    if program is llama and not (config.kv_lens or config.k_transformed):
        assert {"transform", "gradient"} <= kinds
    for spec in _specs(plan):
        assert spec.name == f"attnfuse_{NAME_PARTS.get(spec.kind, spec.kind)}_{plan.signature[:12]}"
        assert _def_line(spec.source, spec.name) == [(p.name, p.kind == CONSTEXPR) for p in spec.launch.params]
        assert set(spec.launch.constants) <= {p.name for p in spec.launch.params if p.kind == CONSTEXPR}


def test_biased_dq_takes_its_gradient_buffer():
    plan = compile_plan(_graph(biased), BASE)
    [gradient] = plan.input_gradients
    assert (gradient.argument, gradient.param, gradient.prefix) == ("bias", "bias", "additive_bias_1")
    spec = plan.dq((gradient,))
    names = [p.name for p in spec.launch.params]
    assert spec.grad_buffers == ("additive_bias_1_dbias",)
    assert names[names.index("additive_bias_1_dbias") :][:5] == [
        "additive_bias_1_dbias",
        *(f"additive_bias_1_dbias_s{i}" for i in range(4)),
    ]


def test_wide_offsets_cast_exactly_the_stride_parameters():
    plan = compile_plan(_graph(sparse), attrs.evolve(BASE, wide_offsets=True))
    source = plan.kernels["forward"].source
    casts = [line.split("=")[0].strip() for line in source.splitlines() if "= tl.cast(" in line and "tl.int64)" in line]
    assert casts == list(plan.kernels["forward"].launch.stride_names)
    assert "stride_btb" not in casts and "block_sparse_1_kv_num_s2" in casts


def test_bind_names_a_missing_or_unknown_argument():
    """Arguments bind by name, strides from the tensor they belong to; a missing or unknown name is named."""
    launch = compile_plan(_graph(llama), BASE).kernels["forward"].launch
    q, k, v, out = (
        torch.empty_strided((1, 2, 3, 4), stride, dtype=torch.float32)
        for stride in ((24, 12, 4, 1), (24, 1, 8, 2), (100, 30, 10, 1), (96, 48, 16, 4))
    )
    rank = {p.name: sum(s.of == p.name for s in launch.params) for p in launch.params if p.kind == "tensor"}
    given = {
        p.name: torch.empty((2,) * rank[p.name]) if p.kind == "tensor" else 7
        for p in launch.params
        if p.kind not in ("stride", "constexpr")
    }
    given.update(Q=q, K=k, V=v, Out=out)
    bound = dict(zip(launch.runtime_names, launch.bind(given)))
    assert [bound[f"stride_q{d}"] for d in "bhmd"] == list(q.stride())
    assert [bound[f"stride_k{d}"] for d in "bhnd"] == list(k.stride())
    assert [bound[f"stride_o{d}"] for d in "bhmd"] == list(out.stride())
    assert [bound[f"rope_0_cos_s{i}"] for i in range(3)] == [4, 2, 1] and bound["Lse"] is given["Lse"]
    del given["HQ"]
    with pytest.raises(TypeError, match=r"missing \['HQ'\], unknown \[\]"):
        launch.bind(given)
    with pytest.raises(TypeError, match=r"missing \[\], unknown \['stride_qb'\]"):
        launch.bind({**given, "HQ": 2, "stride_qb": 1})
    with pytest.raises(TypeError, match=r"wrong number of dimensions"):
        launch.bind({**given, "HQ": 2, "Q": q[0]})
    with pytest.raises(TypeError, match=r"constexprs .* missing \['EVEN_M'\]"):
        launch.constexprs({"EVEN_K": True})


@pytest.mark.parametrize("lo", ["0", "(0)", " 0 ", "((0))"])
def test_a_fact_starting_at_zero_is_parsed_not_compared(lo):
    """Block facts are parsed when declared: "(0)" is 0, so the loops are the same as for "0"."""
    from attnfuse.combinator import Range
    from attnfuse.passes.codegen import forward_params, generate_forward
    from attnfuse.passes.lower import masked_head

    assert Range(lo, "$q_hi + 1").starts_at_zero
    assert not Range("$q_lo - 4", "$q_hi + 1").starts_at_zero and not Range("0.0 + 1", "Nk").starts_at_zero
    lowered = lowered_of(_graph(llama), BASE)
    [causal] = lowered.masks
    facts = attrs.evolve(
        causal.fragment, kv_range=(lo, causal.fragment.kv_range.hi), full_range=(lo, causal.fragment.full_range.hi)
    )
    rewritten = attrs.evolve(lowered, masks=(attrs.evolve(causal, fragment=facts),))
    assert not masked_head(rewritten.masks)
    source = generate_forward(rewritten, "k", forward_params(rewritten))
    assert "# masked head" not in source
    assert source == generate_forward(lowered, "k", forward_params(lowered)).replace(
        "tl.maximum(lo, 0 - 0)", f"tl.maximum(lo, {lo} - 0)"
    ).replace("tl.maximum(full_lo, 0 - 0)", f"tl.maximum(full_lo, {lo} - 0)")


def test_float64_accumulates_in_float64_without_rewriting_text():
    """The accumulation type is spelt by codegen and by fragments' $acc_dtype; nothing else changes."""
    lowered32 = lowered_of(_graph(alibi_window), BASE)
    lowered64 = lowered_of(_graph(alibi_window), attrs.evolve(BASE, dtype="float64"))
    assert (lowered32.accumulator, lowered64.accumulator) == ("tl.float32", "tl.float64")
    source32 = compile_plan(_graph(alibi_window), BASE).kernels["forward"].source
    source64 = compile_plan(_graph(alibi_window), attrs.evolve(BASE, dtype="float64")).kernels["forward"].source
    assert "tl.float64" not in source32 and "tl.float32" not in source64
    assert "tl.load(alibi_1_slopes + h * alibi_1_slopes_s0).to(tl.float64)" in source64


def test_runtime_reads_plans_not_codegen():
    """The runtime launches what the plan describes: no runtime module imports the code generator."""
    import pathlib

    import attnfuse.runtime

    offenders = []
    for path in pathlib.Path(attnfuse.runtime.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders += [f"{path.name}: {m}" for m in modules if "codegen" in m]
    assert offenders == []


@pytest.mark.parametrize("program", [llama, biased], ids=lambda p: p.fn.__name__)
def test_the_plan_holds_its_kernels_by_kind_of_the_one_registry(program):
    """``Plan.kernels`` maps each kind of ``KERNEL_KINDS`` the program has to its spec, read-only; the dQ
    kernel there writes no tensor gradient. Every registered kind is a kernel ``source`` can show (the
    passes' kinds where the keys have a qk transform), and a kind outside the registry is refused."""
    plan = compile_plan(_graph(program), BASE)
    hoisted = program is llama
    assert set(plan.kernels) == set(KERNEL_KINDS) - (set() if hoisted else {"transform", "gradient"})
    assert all(spec.kind == kind for kind, spec in plan.kernels.items())
    assert plan.dq() is plan.kernels["dq"] and plan.kernels["dq"].grad_buffers == ()
    with pytest.raises(TypeError):
        plan.kernels["forward"] = plan.kernels["decode"]
    with pytest.raises(ValueError, match=r"unknown kinds \['backward'\]"):
        attrs.evolve(plan, kernels={**plan.kernels, "backward": plan.kernels["dkdv"]})
    with pytest.raises(ValueError, match=r"missing \['decode'\]"):
        attrs.evolve(plan, kernels={k: s for k, s in plan.kernels.items() if k != "decode"})
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    extra = (torch.randn(1, 2, 40, 40),) if program is biased else ()
    for kind in plan.kernels:
        name = f"attnfuse_{NAME_PARTS.get(kind, kind)}_{plan.signature[:12]}"
        assert f"def {name}(" in program.source(q, k, v, *extra, kernel=kind), kind
    with pytest.raises(af.InputError, match="kernel must be one of forward, decode, dkdv, dq, transform, gradient"):
        program.source(q, k, v, *extra, kernel="backward")
