"""Every hand-written kernel launches through a ``LaunchSpec``: its spec names the kernel function's
parameters in order (so a launch binds by name, never by position), and the launchers give exactly those
names. The template instances (Gluon) cannot run here: their launches run up to the launch, which is recorded."""

import attrs
import pytest
import torch

from attnfuse.examples import EXAMPLES
from attnfuse.kernels.dq_launch import TemplateDq
from attnfuse.kernels.launch import TemplateDkdv, TemplateForward
from attnfuse.launch_spec import CONSTEXPR
from attnfuse.passes.compiler import compile as compile_plan
from attnfuse.plan import DROPOUT_P, DROPOUT_SCALE, DROPOUT_STATE, KernelConfig
from attnfuse.runtime import combine, hopper, template_rows, validate
from attnfuse.runtime.backward import BackwardKernels
from attnfuse.runtime.dropout import Dropout, dropout_state
from attnfuse.runtime.forward import ForwardKernel
from attnfuse.runtime.inputs import kv_cache

SPECS = {
    "combine": (combine.COMBINE, combine._jitted),
    "validate": (validate.CHECK, validate._jitted),
    "template rows": (template_rows.TEMPLATE_ROWS, template_rows._jitted),
}
SM90 = KernelConfig(
    arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, group=4, save_lse=True, fp32_precision="ieee"
)


@pytest.mark.parametrize("name", SPECS)
def test_spec_names_the_kernels_parameters_in_order(name):
    spec, launcher = SPECS[name]
    fn = launcher.fn
    assert spec.kernel == fn.__name__
    assert [p.name for p in spec.params] == list(fn.arg_names)
    assert [p.kind == CONSTEXPR for p in spec.params] == [p.is_constexpr for p in fn.params]


class _Recorder:
    """Stands for a Gluon kernel's launcher: keeps each launch's runtime arguments by name, and its
    constexprs."""

    def __init__(self, spec):
        self.spec, self.launches = spec, []

    def launch(self, grid, args, constexprs, **options):
        self.launches.append((dict(zip(self.spec.runtime_names, args)), constexprs))


def _instance(kind: str, monkeypatch):
    """The causal program's instance of ``kind`` at head dim 128, GQA group 4, its launches recorded."""
    spec = compile_plan(EXAMPLES["gpt2"].graph(), SM90).templates.kernels[kind]
    cls = {"forward": TemplateForward, "dkdv": TemplateDkdv, "dq": TemplateDq}[kind]
    extra = {"has_lse": True} if kind in ("dkdv", "dq") else {}
    instance = cls(spec, 0.125, 0.25, "key", **extra)
    monkeypatch.setattr(instance, "_launcher", _Recorder(spec.launch))
    return instance


def _rows(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


def test_forward_instance_binds_every_argument_by_name(monkeypatch):
    instance = _instance("forward", monkeypatch)
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 1, 100, 130, 128
    q, out = _rows(B, Hq, Nq, D), _rows(B, Hq, Nq, D)
    k, v = _rows(B, Hkv, Nk, D), _rows(B, Hkv, Nk, D)
    lse = torch.empty(B, Hq, Nq)
    instance(q, k, v, out, lse, {})
    [(args, constexprs)] = instance._launcher.launches
    assert (args["Nq"], args["N_K"], args["HQ"], args["GROUP"]) == (Nq, Nk, Hq, 4)
    assert (args["sm_scale"], args["qk_scale"]) == (0.125, 0.25)
    assert args["Q"] is q and args["K"] is k and args["V"] is v and args["Out"] is out and args["Lse"] is lse
    assert [args[d].base for d in ("q_desc", "k_desc", "v_desc", "o_desc")] == [q, k, v, out]
    assert constexprs["SAVE_LSE"] is True


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_dkdv_instance_binds_every_argument_by_name(monkeypatch, parts):
    instance = _instance("dkdv", monkeypatch)
    monkeypatch.setattr(hopper, "_group_parts", lambda programs, group, device: parts)
    B, Hq, Hkv, Nq, Nk, D = 2, 8, 2, 100, 130, 128
    q, dout = _rows(B, Hq, Nq, D), _rows(B, Hq, Nq, D)
    k, v = _rows(B, Hkv, Nk, D), _rows(B, Hkv, Nk, D)
    dk, dv = torch.empty(B, Nk, Hkv, D).transpose(1, 2), torch.empty(B, Hkv, Nk, D)
    lse, delta = torch.randn(B, Hq, Nq), torch.randn(B, Hq, Nq)
    instance(q, k, v, dout, lse, delta, dk, dv, {})
    [(args, constexprs)] = instance._launcher.launches
    assert [args[f"stride_dk{d}"] for d in "bhn"] == list(dk.stride()[:3])
    assert [args[f"stride_dv{d}"] for d in "bhn"] == list(dv.stride()[:3])
    assert (args["Nq"], args["N_K"], args["HQ"], args["GROUP"], args["heads"]) == (Nq, Nk, Hq, 4, 4 // parts)
    assert args["row_stride"] == 128 and args["part_size"] == B * Hkv * Nk * D
    assert (args["sm_scale"], args["qk_scale"]) == (0.125, 0.25)
    lse_rows, delta_rows = (args[d].base for d in ("lse_desc", "delta_desc"))
    want_lse, want_delta = template_rows.template_rows(lse, 64, delta=delta, natural=True)
    assert torch.equal(lse_rows, want_lse) and torch.equal(delta_rows, want_delta)
    assert args["DKey"] is dk and args["DValue"] is dv
    parts_shape = {1: dk.shape, 2: (2, B, Hkv, Nk, D), 4: (B, Hkv, Nk, D)}[parts]  # shares of dK: none, each, a sum
    assert args["dk_part"].shape == args["dv_part"].shape == parts_shape
    assert constexprs["GROUP_SUM"] == {1: "none", 2: "last", 4: "atomic"}[parts]


@pytest.mark.parametrize("with_dlse", [False, True])
def test_dq_instance_binds_every_argument_by_name(monkeypatch, with_dlse):
    instance = _instance("dq", monkeypatch)
    B, Hq, Hkv, Nq, Nk, D = 2, 8, 2, 100, 130, 128
    q, out, dout = _rows(B, Hq, Nq, D), _rows(B, Hq, Nq, D), _rows(B, Hq, Nq, D)
    k, v = _rows(B, Hkv, Nk, D), _rows(B, Hkv, Nk, D)
    dq = torch.empty(B, Nq, Hq, D, dtype=torch.float32).transpose(1, 2)  # HF's layout, a float32 gradient
    lse, delta = torch.randn(B, Hq, Nq), torch.empty(B, Hq, Nq)
    dlse = torch.randn(B, Hq, Nq) if with_dlse else None
    instance(q, k, v, out, dout, lse, dlse, delta, dq, {})
    [(args, constexprs)] = instance._launcher.launches
    assert [args[f"stride_dq{d}"] for d in "bhm"] == list(dq.stride()[:3])
    assert (args["Nq"], args["N_K"], args["HQ"], args["GROUP"]) == (Nq, Nk, Hq, 4)
    assert (args["sm_scale"], args["qk_scale"]) == (0.125, 0.25)
    assert [args[d].base for d in ("q_desc", "do_desc", "k_desc", "v_desc", "o_desc")] == [q, dout, k, v, out]
    block_n = instance.spec.tiles.block_n
    assert [args[d].block_shape for d in ("q_desc", "k_desc")] == [[1, 1, 64, D], [1, 1, block_n, D]]
    assert args["O"] is out and args["Lse"] is lse and args["Delta"] is delta and args["DQuery"] is dq
    assert args["DLse"] is (dlse if with_dlse else delta)  # a placeholder the instance never reads
    assert constexprs["HAS_DLSE"] is with_dlse


def test_runtime_gives_the_instances_with_dropout_the_calls_dropout_state(monkeypatch):
    """A call with attention dropout hands its state, p and 1 / (1 - p) to the forward, dK/dV and dQ template
    instances (which bind every parameter by name: a missing one is a TypeError), as to the generated kernels."""
    monkeypatch.setenv("ATTNFUSE_TEMPLATES", "all")
    plan = compile_plan(EXAMPLES["gpt2"].graph(), attrs.evolve(SM90, dropout=True))
    p = 0.25
    dropout = Dropout(p, dropout_state("cpu"))
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 1, 70, 90, 128
    q, k, v, dout = _rows(B, Hq, Nq, D), _rows(B, Hkv, Nk, D), _rows(B, Hkv, Nk, D), _rows(B, Hq, Nq, D)
    kv = kv_cache(k, v, None, None, None, dropout=dropout)
    forward = ForwardKernel(plan)
    monkeypatch.setattr(forward.template, "_launcher", _Recorder(forward.template.spec.launch))
    out, lse = forward(q, kv, {})
    backward = BackwardKernels(plan, ())
    for instance in (backward.template, backward.dq_template):
        monkeypatch.setattr(instance, "_launcher", _Recorder(instance.spec.launch))
    monkeypatch.setattr(hopper, "_group_parts", lambda programs, group, device: 1)
    backward(q, kv, out, lse, dout, None, {})
    for instance in (forward.template, backward.template, backward.dq_template):
        [(args, _)] = instance._launcher.launches
        assert args[DROPOUT_STATE] is dropout.state
        assert (args[DROPOUT_P], args[DROPOUT_SCALE]) == (p, 1 / (1 - p))
