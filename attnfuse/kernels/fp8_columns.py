"""The float8 forward template's loads of V's transposed copy (``fp8_pipeline``) at columns that are not K's rows:
a packed call's copy starts each document on a column of its own (``launch_fp8_packed.document_values``: the
instance's ``v_start``), and a listed program's loader brings its lists' blocks a step at a time, on
``listed_pipeline.load_key_block``'s protocol. An instance that uses them imports ``listed_pipeline`` too, so that
its name follows that module's code."""

from __future__ import annotations

from ..triton_compat import gl, gluon, mbarrier, tma
from .listed_pipeline import load_query_tiles


@gluon.jit
def load_key_block_fp8(
    k_desc, vt_desc, k_smem, vt_smem, k_ready, v_ready, kv_free, b, hk, key, column, j, STAGES: gl.constexpr
):  # fmt: skip
    """Step ``j``: K's rows key.. and Vᵀ's columns column.. (a multiple of ``fp8_pipeline.KEY_CHUNK``) into stage
    j % STAGES, once both consumers freed it. TMA fills what lies past a tensor's end with zeros."""
    stage = j % STAGES
    mbarrier.wait(kv_free.index(stage), ((j // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, key, 0], k_ready.index(stage), k_smem.index(stage))
    mbarrier.expect(v_ready.index(stage), vt_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(vt_desc, [b, hk, 0, column], v_ready.index(stage), vt_smem.index(stage))


@gluon.jit
def document_loader_fp8(
    q_desc, k_desc, vt_desc, q_smem, k_smem, vt_smem, bars, b, h, hk, m0, start, v_start, n_steps,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp of a packed call's program: the two Q tiles of rows m0.., then key block j (K's rows
    start + j * BLOCK_N.., Vᵀ's columns v_start + j * BLOCK_N..) into stage j % STAGES."""
    q_ready, k_ready, v_ready, kv_free = bars
    load_query_tiles(q_desc, q_smem, q_ready, b, h, m0)
    for j in range(n_steps):
        load_key_block_fp8(
            k_desc, vt_desc, k_smem, vt_smem, k_ready, v_ready, kv_free, b, hk, start + j * BLOCK_N,
            v_start + j * BLOCK_N, j, STAGES,
        )  # fmt: skip
