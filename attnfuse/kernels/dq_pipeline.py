"""What the dQ template's instances share, in Gluon: the loader warp.

A dQ program is one block of ``2 * ROWS`` query rows of one (batch, query head), as the forward's: two consumer
warpgroups take ``ROWS`` rows each, and a loader warp brings their Q and dO tiles once, then streams the key
blocks they visit (K and V tiles) through ``STAGES`` shared-memory stages (``pipeline.ring``).
"""

from __future__ import annotations

from ..triton_compat import gl, gluon, mbarrier, tma
from .pipeline import ROWS


@gluon.jit
def dq_loader(
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, bars, b, h, hk, m0, start, n_steps,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: the two Q and dO tiles of rows m0.. (half i's on q_ready[i]), then key block j (keys
    start + j * BLOCK_N..) into stage j % STAGES once both consumers freed it. TMA fills rows past a tensor's end
    with zeros."""
    q_ready, k_ready, v_ready, kv_free = bars
    for half in gl.static_range(2):
        mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + half * ROWS, 0], q_ready.index(half), q_smem.index(half))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0 + half * ROWS, 0], q_ready.index(half), do_smem.index(half))
    for j in range(n_steps):
        stage = j % STAGES
        key = start + j * BLOCK_N
        mbarrier.wait(kv_free.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, key, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, key, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def store_dq(dq, dq_ptr, dq_strides, b, h, first, n_q, LAYOUT: gl.constexpr):
    """Stores one consumer's dQ (ROWS rows from ``first``, D; in ``LAYOUT``) at (b, h) of dq_ptr, by its
    (batch, head, row) strides (unit last stride), in its dtype: rows below n_q only."""
    HEAD_DIM: gl.constexpr = dq.shape[1]
    rows = gl.expand_dims(first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT)), 1)
    d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LAYOUT)), 0)
    gl.store(
        dq_ptr
        + b.to(gl.int64) * dq_strides[0]
        + h.to(gl.int64) * dq_strides[1]
        + rows.to(gl.int64) * dq_strides[2]
        + d,
        dq.to(dq_ptr.dtype.element_ty),
        mask=rows < n_q,
    )
