"""A forward call with a fact (kv_lens, given positions, packed sequences) hands the forward template's instance
the fact's arguments, bound to the instance's own parameters, and a packed call's launch its grid; a packed call's
backward likewise its dQ and dK/dV instances (``runtime/forward.py``, ``runtime/backward.py``,
``kernels/launch_packed.py``): on any machine, each launch recorded instead of run (only a
GPU runs an instance: ``verify.fact_cases``)."""

from __future__ import annotations

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.kernels import verified
from attnfuse.kernels.launch import TemplateForward
from attnfuse.kernels.dq_launch import PackedTemplateDq
from attnfuse.kernels.launch_packed import (
    GRID_Y_LIMIT,
    PackedTemplateDkdv,
    PackedTemplateForward,
    document_rows,
    fits_documents,
    fits_pack,
)
from attnfuse.launch_spec import CONSTEXPR
from attnfuse.passes.codegen.packed import padded_start
from attnfuse.plan import KernelConfig
from attnfuse.runtime.backward import BackwardKernels
from attnfuse.runtime.compiled import compiled
from attnfuse.runtime.forward import ForwardKernel
from attnfuse.runtime.inputs import KVCache, Positions
from attnfuse.runtime.packed import Packed, search_steps

SM90 = KernelConfig(
    arch="sm90", dtype="bfloat16", head_dim=64, head_dim_v=64, group=2, save_lse=True, fp32_precision="ieee"
)
Hq, Hkv, D = 4, 2, 64


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


class _Launches:
    """Stands for an instance's launcher: records (grid, the arguments by parameter name, constexprs)."""

    def __init__(self, spec):
        self.names = [p.name for p in spec.launch.params if p.kind != CONSTEXPR]
        self.made: list[tuple] = []

    def launch(self, grid, args, constexprs, **_):
        self.made.append((grid, dict(zip(self.names, args, strict=True)), constexprs))


def _rows(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16)


def _call(fact: str, monkeypatch) -> tuple[dict, tuple, dict, KVCache, torch.Tensor]:
    """A call of ``causal`` with ``fact`` through the sm90 plan's forward, its template's launch recorded:
    (the arguments by name, the grid, the constexprs, the call's keys and values, q)."""
    monkeypatch.setenv(verified.MODE_ENV, "all")
    plan = compiled(causal.graph(), attrs.evolve(SM90, **({fact: True} if fact else {}))).plan
    forward = ForwardKernel(plan)
    assert isinstance(forward.template, PackedTemplateForward if fact == "varlen" else TemplateForward)
    launches = _Launches(forward.template.spec)
    monkeypatch.setattr(forward.template, "_launcher", launches)
    lens = torch.randint(0, 200, (3,), dtype=torch.int32)
    if fact == "varlen":
        docs = int(torch.randint(1, 6, ()))
        cu_q, cu_k = (torch.cat([torch.zeros(1), torch.randint(1, 150, (docs,)).cumsum(0)]).int() for _ in "qk")
        q, k, v = _rows(1, Hq, int(cu_q[-1]), D), _rows(1, Hkv, int(cu_k[-1]), D), _rows(1, Hkv, int(cu_k[-1]), D)
        kv = KVCache(k, v, k.shape[2], packed=Packed(cu_q, cu_k, docs))
    else:
        q, k, v = _rows(3, Hq, 150, D), _rows(3, Hkv, 200, D), _rows(3, Hkv, 200, D)
        kv = KVCache(
            k,
            v,
            200,
            lens=lens if fact == "kv_lens" else None,
            positions=Positions(40, 7, 300) if fact == "positions" else None,
        )
    out, lse = forward(q, kv, {})
    assert out.shape == q.shape and lse.shape == q.shape[:3] and len(launches.made) == 1
    grid, named, constexprs = launches.made[0]
    return named, grid, constexprs, kv, q


@pytest.mark.parametrize("fact", ["", "kv_lens", "positions", "varlen"])
def test_a_call_hands_the_instance_its_tensors_and_its_fact_s_arguments(fact, monkeypatch):
    named, grid, constexprs, kv, q = _call(fact, monkeypatch)
    B, _, Nq, _ = q.shape
    assert named["Q"] is q and named["K"] is kv.k and named["V"] is kv.v and named["Nq"] == Nq
    assert named["N_K"] == kv.k.shape[2] and named["HQ"] == Hq and named["GROUP"] == Hq // Hkv
    assert constexprs["SAVE_LSE"] is True
    facts = {"KvLens", "Q_OFFSET", "K_OFFSET", "N_SEQ", "CuQ", "CuK", "DOCS", "SEARCH_STEPS"}
    given = {
        "": {},
        "kv_lens": {"KvLens": kv.lens},
        "positions": {"Q_OFFSET": 40, "K_OFFSET": 7, "N_SEQ": 300},
        "varlen": {"CuQ": kv.packed and kv.packed.cu_q, "CuK": kv.packed and kv.packed.cu_k},
    }[fact]
    assert facts & set(named) == set(given) | ({"DOCS", "SEARCH_STEPS"} if fact == "varlen" else set())
    assert all(named[n] is value if isinstance(value, torch.Tensor) else named[n] == value for n, value in
               given.items())  # fmt: skip
    if fact == "varlen":  # the generated packed kernels' grid: total // 128 + docs blocks a query head
        docs = kv.packed.docs
        assert named["DOCS"] == docs and named["SEARCH_STEPS"] == search_steps(docs)
        assert grid == (Hq, Nq // 128 + docs)
    else:
        assert grid == (B * Hq, -(-Nq // 128))


def test_a_pack_whose_blocks_overflow_a_grid_runs_the_generated_kernel(monkeypatch):
    total = int(torch.randint(1000, 100_000, ()))
    docs = GRID_Y_LIMIT - total // 128
    assert fits_pack(total, docs) and not fits_pack(total, docs + 1)
    monkeypatch.setenv(verified.MODE_ENV, "all")
    forward = ForwardKernel(compiled(causal.graph(), attrs.evolve(SM90, varlen=True)).plan)
    launches = _Launches(forward.template.spec)
    monkeypatch.setattr(forward.template, "_launcher", launches)
    generated = []
    monkeypatch.setattr(forward.kernel, "launch", lambda *args, **kwargs: generated.append(args))
    q, k, v = _rows(1, Hq, 300, D), _rows(1, Hkv, 300, D), _rows(1, Hkv, 300, D)
    many = GRID_Y_LIMIT  # documents, most of them empty: one launch's grid cannot hold their blocks
    cu = torch.cat([torch.zeros(many, dtype=torch.int32), torch.tensor([300], dtype=torch.int32)])
    forward(q, KVCache(k, v, 300, packed=Packed(cu, cu.clone(), many)), {})
    assert launches.made == [] and len(generated) == 1


def test_a_packed_backward_hands_both_instances_the_pack_and_launches_the_packed_grids(monkeypatch):
    """A packed call's backward runs the packed dQ and dK/dV instances: each launch gets the document offsets and
    their count; dQ's grid is the packed forward's (Hq, total_q // 128 + docs), dK/dV's (Hkv, total_k // 128 +
    docs), each program with all of its GQA group's query heads (GROUP_SUM "none": stored, never summed)."""
    monkeypatch.setenv(verified.MODE_ENV, "all")
    plan = compiled(causal.graph(), attrs.evolve(SM90, varlen=True)).plan
    kernels = BackwardKernels(plan, ())
    assert isinstance(kernels.dq_template, PackedTemplateDq) and isinstance(kernels.template, PackedTemplateDkdv)
    launches = {kind: _Launches(t.spec) for kind, t in (("dq", kernels.dq_template), ("dkdv", kernels.template))}
    monkeypatch.setattr(kernels.dq_template, "_launcher", launches["dq"])
    monkeypatch.setattr(kernels.template, "_launcher", launches["dkdv"])
    docs = int(torch.randint(1, 6, ()))
    cu_q, cu_k = (torch.cat([torch.zeros(1), torch.randint(1, 150, (docs,)).cumsum(0)]).int() for _ in "qk")
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q, out, dout = _rows(1, Hq, total_q, D), _rows(1, Hq, total_q, D), _rows(1, Hq, total_q, D)
    k, v = _rows(1, Hkv, total_k, D), _rows(1, Hkv, total_k, D)
    kernels(
        q, KVCache(k, v, total_k, packed=Packed(cu_q, cu_k, docs)), out, torch.randn(1, Hq, total_q), dout, None, {}
    )
    (dq_grid, dq_args, _), (dkdv_grid, dkdv_args, dkdv_constexprs) = launches["dq"].made[0], launches["dkdv"].made[0]
    assert dq_grid == (Hq, total_q // 128 + docs) and dkdv_grid == (Hkv, total_k // 128 + docs)
    assert dkdv_constexprs["GROUP_SUM"] == "none" and dkdv_args["heads"] == Hq // Hkv
    assert dkdv_args["row_stride"] == -(-(total_q + 64 * docs) // 64) * 64
    for named in (dq_args, dkdv_args):
        assert named["CuQ"] is cu_q and named["CuK"] is cu_k and named["DOCS"] == docs
        assert named["SEARCH_STEPS"] == search_steps(docs) and named["Nq"] == total_q and named["N_K"] == total_k


@pytest.mark.parametrize("seed", range(3))
def test_document_rows_start_each_document_on_a_query_block(seed):
    """The dK/dV template's rows of a packed call (``document_rows``): each head's lse and delta of document i at
    the block-aligned start the kernel computes (``packed.padded_start``: (cu_q[i] + 64 i) // 64 * 64), in order,
    no two documents' rows overlapping, -inf and 0 everywhere else; empty documents take no rows."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 150, (6,), generator=gen) * (torch.rand(6, generator=gen) < 0.7)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int()
    docs, total = len(lengths), int(cu_q[-1])
    lse, delta = torch.randn(1, Hq, total), torch.randn(1, Hq, total)
    lse_rows, delta_rows, stride = document_rows(lse, delta, cu_q, docs)
    assert stride % 64 == 0 and lse_rows.shape == delta_rows.shape == (Hq * stride,)
    lse_rows, delta_rows = lse_rows.view(Hq, stride), delta_rows.view(Hq, stride)
    placed = torch.zeros(stride, dtype=torch.bool)
    for doc in range(docs):
        first, n = int(cu_q[doc]), int(lengths[doc])
        start = eval(padded_start("q_start", "64"), {"q_start": first, "doc": doc})
        assert start % 64 == 0 and not placed[start : start + n].any()
        placed[start : start + n] = True
        assert torch.equal(lse_rows[:, start : start + n], lse[0, :, first : first + n])
        assert torch.equal(delta_rows[:, start : start + n], delta[0, :, first : first + n])
    assert (lse_rows[:, ~placed] == float("-inf")).all() and (delta_rows[:, ~placed] == 0).all()


def test_a_pack_whose_key_blocks_or_rows_overflow_keeps_the_generated_dkdv_kernel():
    """``fits_documents``: the dK/dV instance of a packed call runs only where one launch's grid
    holds the pack's key blocks (total_k // 128 + docs of them) and int32 TMA coordinates reach its rows of lse and
    delta (each document's rows starting on a 64-row block: Hq x (total_q + 64 docs) rounded up)."""
    total = int(torch.randint(1000, 100_000, ()))
    docs = GRID_Y_LIMIT - total // 128
    assert fits_documents(Hq, total, total, docs)
    assert not fits_documents(Hq, total, total, docs + 1)  # one key block too many
    rows = 2**31 // 64 // 64 * 64  # a head's rows, in whole blocks, at which 64 query heads reach 2**31
    assert fits_documents(64, rows - 64 - 64, total, 1)
    assert not fits_documents(64, rows - 64, total, 1)
