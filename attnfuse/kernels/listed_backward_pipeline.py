"""The backward templates' loads for a program whose mask lists its blocks (block sparsity), in Gluon.

An instance of such a program writes its own loader warp (``kernels/dkdv_listed.py``, ``kernels/dq_listed.py``):
it reads the mask's lists with the plugin's fragments. A dK/dV instance brings its keys once
(``load_key_tiles``), then each step's query tile through ``load_query_tile`` into the ring of ``pipeline.ring``,
on the protocol of ``dkdv_pipeline.dkdv_loader``, with the step itself for the consumers (``read_step``: they
follow no list); a dQ instance brings its rows once (``load_query_rows``), then
each step's key block through ``listed_pipeline.load_key_block``, on the protocol of ``dq_pipeline.dq_loader``
(a stage is refilled once both consumers freed it).
"""

from __future__ import annotations

from ..triton_compat import gl, gluon, mbarrier, tma
from .pipeline import ROWS


@gluon.jit
def load_key_tiles(k_desc, v_desc, k_smem, v_smem, bars, b, hkv, n0):
    """Both halves' K and V tiles, keys n0.. (2 * ROWS) of kv head hkv, each half on its ready barrier."""
    kv_ready = bars[0]
    for half in gl.static_range(2):
        mbarrier.expect(kv_ready.index(half), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hkv, n0 + half * ROWS, 0], kv_ready.index(half), k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [b, hkv, n0 + half * ROWS, 0], kv_ready.index(half), v_smem.index(half))


@gluon.jit
def load_query_tile(
    q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, steps, bars, b, h, m, partial,
    t, row_stride, heads_q, STAGES: gl.constexpr, HAS_LSE: gl.constexpr, HAS_DELTA: gl.constexpr,
):  # fmt: skip
    """Step ``t``: the Q tile of rows m.. of query head h (with their lse, HAS_LSE) and its dO tile (with their
    delta, HAS_DELTA) into stage t % STAGES, once both consumers freed it, and the step itself (h, m and
    ``partial``, 1 where the step's block is partial) into the stage's row of ``steps`` (``read_step``). TMA
    fills rows past a tensor's end with zeros."""
    _, q_ready, do_ready, free = bars
    stage = t % STAGES
    mbarrier.wait(free.index(stage), ((t // STAGES) & 1) ^ 1)
    field = gl.arange(0, 4, layout=gl.BlockedLayout([4], [32], [1], [0]))
    steps.index(stage).store(gl.where(field == 0, h, gl.where(field == 1, m, partial)))
    gl.thread_barrier()  # the warp's stores before its arrive on q_ready publishes them
    row = (b * heads_q + h) * row_stride + m  # in lse's and delta's flat rows
    if HAS_LSE:
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(lse_desc, [row], q_ready.index(stage), lse_smem.index(stage))
    else:
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, m, 0], q_ready.index(stage), q_smem.index(stage))
    if HAS_DELTA:
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(delta_desc, [row], do_ready.index(stage), delta_smem.index(stage))
    else:
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [b, h, m, 0], do_ready.index(stage), do_smem.index(stage))


@gluon.jit
def read_step(steps, stage):
    """A consumer warpgroup's read of the step ``load_query_tile`` wrote into stage ``stage`` (once its q_ready
    phase completed): its query head, first row and whether its block is partial."""
    field = gl.arange(0, 4, layout=gl.BlockedLayout([4], [32], [4], [0]))
    step = steps.index(stage).load(gl.BlockedLayout([4], [32], [4], [0]))
    h = gl.sum(gl.where(field == 0, step, 0), axis=0)
    m = gl.sum(gl.where(field == 1, step, 0), axis=0)
    return h, m, gl.sum(gl.where(field == 2, step, 0), axis=0) != 0


@gluon.jit
def load_query_rows(q_desc, do_desc, q_smem, do_smem, q_ready, b, h, m0):
    """The program's two Q and dO tiles, rows m0.. (2 * ROWS) of query head h, half i's on q_ready[i]."""
    for half in gl.static_range(2):
        mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + half * ROWS, 0], q_ready.index(half), q_smem.index(half))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0 + half * ROWS, 0], q_ready.index(half), do_smem.index(half))
