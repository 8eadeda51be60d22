"""Every hand-written kernel launches through a ``LaunchSpec``: its spec names the kernel function's
parameters in order (so a launch binds by name, never by position), and the launchers give exactly those
names. The Hopper (Gluon) kernels cannot run here: their launches run up to the launch, which is recorded."""

import pytest
import torch

from attnfuse.launch_spec import CONSTEXPR
from attnfuse.plan import HopperPlan
from attnfuse.runtime import combine, hopper, template_rows, validate

SPECS = {
    "hopper forward": (hopper.FORWARD, hopper.HopperLauncher._launcher),
    "hopper dkdv": (hopper.DKDV, hopper.HopperLauncher._dkdv),
    "combine": (combine.COMBINE, combine._jitted),
    "validate": (validate.CHECK, validate._jitted),
    "template rows": (template_rows.TEMPLATE_ROWS, template_rows._jitted),
}


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


@pytest.fixture
def recorded(monkeypatch):
    forward, dkdv = _Recorder(hopper.FORWARD), _Recorder(hopper.DKDV)
    monkeypatch.setattr(hopper.HopperLauncher, "_launcher", forward)
    monkeypatch.setattr(hopper.HopperLauncher, "_dkdv", dkdv)
    return forward, dkdv


def _rows(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


def test_hopper_forward_binds_every_argument_by_name(recorded):
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 100, 130, 128
    q, out = _rows(B, Hq, Nq, D), _rows(B, Hq, Nq, D)
    k, v = _rows(B, Hkv, Nk, D), _rows(B, Hkv, Nk, D)
    lse = torch.empty(B, Hq, Nq)
    hopper.HopperLauncher(HopperPlan(causal=True, qk_scale=0.25, scale=0.125))(q, k, v, out, lse)
    [(args, constexprs)] = recorded[0].launches
    assert (args["n_q"], args["n_k"], args["heads_q"], args["group"], args["qk_scale"]) == (Nq, Nk, Hq, 2, 0.25)
    assert args["q"] is q and args["k"] is k and args["v"] is v and args["out"] is out and args["lse"] is lse
    assert [args[d].base for d in ("q_desc", "k_desc", "v_desc", "o_desc")] == [q, k, v, out]
    assert constexprs == {"BLOCK_N": 128, "STAGES": 3, "CAUSAL": True, "SAVE_LSE": True}


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_hopper_dkdv_binds_every_argument_by_name(recorded, monkeypatch, parts):
    monkeypatch.setattr(hopper, "_group_parts", lambda programs, group, device: parts)
    B, Hq, Hkv, Nq, Nk, D = 2, 8, 2, 100, 130, 128
    q, dout = _rows(B, Hq, Nq, D), _rows(B, Hq, Nq, D)
    k, v = _rows(B, Hkv, Nk, D), _rows(B, Hkv, Nk, D)
    dk, dv = torch.empty(B, Nk, Hkv, D).transpose(1, 2), torch.empty(B, Hkv, Nk, D)
    rows = hopper.HopperLauncher.rows(torch.randn(B, Hq, Nq), delta=torch.randn(B, Hq, Nq))
    hopper.HopperLauncher(HopperPlan(causal=False, qk_scale=0.25, scale=0.125)).dkdv(q, k, v, dout, rows, dk, dv)
    [(args, constexprs)] = recorded[1].launches
    assert [args[f"stride_dk{d}"] for d in "bhn"] == list(dk.stride()[:3])
    assert [args[f"stride_dv{d}"] for d in "bhn"] == list(dv.stride()[:3])
    assert (args["n_q"], args["n_k"], args["heads_q"], args["group"], args["heads"]) == (Nq, Nk, Hq, 4, 4 // parts)
    assert args["row_stride"] == 128 and args["part_size"] == B * Hkv * Nk * D and args["dq_desc"] is None
    assert (args["qk_scale"], args["scale"]) == (0.25, 0.125)
    assert [args[d].base for d in ("lse_desc", "delta_desc")] == list(rows)
    assert args["dk"] is dk and args["dv"] is dv
    parts_shape = {1: dk.shape, 2: (2, B, Hkv, Nk, D), 4: (B, Hkv, Nk, D)}[parts]  # shares of dK: none, each, a sum
    assert args["dk_part"].shape == args["dv_part"].shape == parts_shape
    assert constexprs == {
        "BLOCK_M": 64,
        "STAGES": 2,
        "CAUSAL": False,
        "FUSE_DQ": False,
        "GROUP_SUM": {1: "none", 2: "last", 4: "atomic"}[parts],
    }
