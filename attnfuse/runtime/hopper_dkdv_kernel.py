"""The Hopper dK/dV template, in Gluon: the backward of softmax attention with a causal mask or none, for
the keys and values and, with FUSE_DQ, the queries, warp-specialised like the forward template
(``hopper_kernel.py``).

One program per (128-key block, batch x kv head), or, when that grid is small, per (128-key block, batch x
part of a GQA group's query heads). A loader warp brings the block's two 64-row K and V tiles once, then
the Q and dO tiles of every query block that sees the keys, with their rows' lse and delta, for each of
the program's query heads, through TMA into a ring of ``STAGES`` stages; two consumer warpgroups take 64
keys each and free a stage when both have read it. A consumer recomputes its weights transposed, (keys,
queries), so they and dS enter the dV and dK products as register operands (FlashAttention's order):

    Sᵀ = K·Qᵀ, Pᵀ = exp2(Sᵀ·qk_scale − lse₂), dPᵀ = V·dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − delta),
    dV += Pᵀ·dO, dK += dSᵀ·Q, and at the end dK *= scale.

Sᵀ and dPᵀ are issued together, and a step's softmax runs while dPᵀ multiplies. A step waits for its dV
and dK products before the next one starts: carrying them in flight across steps makes ptxas serialise
every wgmma (too few registers). The row statistics come from shared memory when they are needed, not
from registers loaded a step ahead: their 32 registers a thread made ptxas spill inside the loop.

With FUSE_DQ each consumer also stages its dSᵀ in shared memory; once both halves are there (an
mbarrier), each computes half of the step's dQ columns, dS·K[:, half] over all 128 keys, and stages it
(times scale) for a reducer warp, which adds it into dQ's float32 accumulator with a TMA reduce-add.
Programs add into the same dQ tiles in no fixed order, so dQ's last bits vary from run to run.

lse₂ (lse in log2 units) and delta = rowsum(dO ∘ O) − dlse are read from ``template_rows.py``'s padded
rows: +inf and 0 where a row keeps no key and past Nq, so those rows' weights are 0 without a test a step.
A masked pair's weight and dS are 0, whatever its key's value (dPᵀ carries a masked key's NaN value). TMA
reads only inside the tensors' shapes (zeros past them), and with FUSE_DQ keys past Nk get dS 0. dK and
dV are stored from registers, masked to the keys below Nk, in their own dtype (float32 dK for a hoisted
transform's gradient pass). When a group's heads are split over programs, their float32 shares are added
up atomically, or, deterministically, stored and counted, and the group's last program to finish sums them
in order (the generated kernel's split, ``passes/codegen/head_split.py``): GROUP_SUM.
"""

from __future__ import annotations

from ..triton_compat import (
    builtin,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from ..triton_compat import libtriton_ir as ir

from ..kernels.dkdv_pipeline import store_program_grads
from ..kernels.pipeline import ROWS, ring, warpgroup_layout


@gluon.jit
def _loader(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    lse_desc,
    delta_desc,
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    lse_smem,
    delta_smem,
    bars,
    b,
    h0,
    hkv,
    n0,
    j_lo,
    n_qblocks,
    n_iter,
    row_stride,
    heads_q,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: both halves' K and V tiles, then step t's Q tile with its rows' lse and its dO tile with
    their delta into stage t % STAGES once both consumers freed it. Step t is query block
    j_lo + t % n_qblocks of query head h0 + t // n_qblocks."""
    kv_ready, q_ready, do_ready, free, _, _, _ = bars
    for half in gl.static_range(2):
        mbarrier.expect(kv_ready.index(half), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hkv, n0 + half * ROWS, 0], kv_ready.index(half), k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [b, hkv, n0 + half * ROWS, 0], kv_ready.index(half), v_smem.index(half))
    for t in range(n_iter):
        stage = t % STAGES
        h = h0 + t // n_qblocks
        m = (j_lo + t % n_qblocks) * BLOCK_M
        mbarrier.wait(free.index(stage), ((t // STAGES) & 1) ^ 1)
        row = (b * heads_q + h) * row_stride + m  # in lse's and delta's flat rows
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m, 0], q_ready.index(stage), q_smem.index(stage))
        tma.async_copy_global_to_shared(lse_desc, [row], q_ready.index(stage), lse_smem.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, h, m, 0], do_ready.index(stage), do_smem.index(stage))
        tma.async_copy_global_to_shared(delta_desc, [row], do_ready.index(stage), delta_smem.index(stage))


@gluon.jit
def _keep(key_pos, query, n_q, n_k):
    """Whether each (key, query) pair is kept by the causal mask, bottom-right aligned (the last query
    keeps the last key): key_pos (64, 1) key indices, query (BLOCK_M,) query row indices."""
    return key_pos <= gl.expand_dims(query + (n_k - n_q), 0)


@builtin
def _tma_add(tensor_desc, coord, src, _semantic=None):
    """Add shared-memory tile ``src`` into ``tensor_desc``'s tensor at ``coord`` with one TMA reduce
    (cp.reduce.async.bulk.tensor, asynchronous like a TMA store; ``tma.store_wait`` waits for it). Triton
    3.6 builds the op, but Gluon's Hopper ``tma`` module does not expose it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _reducer(dq_desc, dq_smem, bars, b, h0, j_lo, n_qblocks, n_iter, BLOCK_M: gl.constexpr, FUSE_DQ: gl.constexpr):
    """One warp (idle without FUSE_DQ): adds each step's two dQ halves, once the consumers staged them, into
    dQ's float32 accumulator, and frees the staging tiles once the reduces have read them."""
    _, _, _, _, _, dq_full, dq_empty = bars
    if FUSE_DQ:
        COLUMNS: gl.constexpr = dq_desc.block_type.shape[3]
        for t in range(n_iter):
            for half in gl.static_range(2):
                mbarrier.wait(dq_full.index(half), t & 1)
                _tma_add(
                    dq_desc,
                    [b, h0 + t // n_qblocks, (j_lo + t % n_qblocks) * BLOCK_M, half * COLUMNS],
                    dq_smem.index(half),
                )
            tma.store_wait(0)
            mbarrier.arrive(dq_empty.index(0), count=1)
            mbarrier.arrive(dq_empty.index(1), count=1)


@gluon.jit
def _dq_half(ds, ds_smem, k_smem, ds_ready, no_dq, t, HALF: gl.constexpr):
    """Issues this warpgroup's half of step t's dQ columns, dS (queries, 128 keys) · K[:, half], once both
    consumers have staged their dSᵀ (ds: this one's, (64 keys, queries)) in the buffers of step t's parity."""
    columns: gl.constexpr = no_dq.shape[1]  # D / 2
    HEAD_DIM: gl.constexpr = 2 * columns
    first = 2 * (t % 2)  # buffers first + HALF for each half's keys
    ds_smem.index(first + HALF).store(ds)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ds_ready, count=1)
    mbarrier.wait(ds_ready, t & 1)
    dq = warpgroup_mma(
        ds_smem.index(first).permute((1, 0)),
        k_smem.index(0).reshape([ROWS, HEAD_DIM]).slice(HALF * columns, columns, 1),
        no_dq,
        use_acc=False,
        is_async=True,
    )
    return warpgroup_mma(
        ds_smem.index(first + 1).permute((1, 0)),
        k_smem.index(1).reshape([ROWS, HEAD_DIM]).slice(HALF * columns, columns, 1),
        dq,
        is_async=True,
    )


@gluon.jit
def _consumer(
    k_desc,
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    lse_smem,
    delta_smem,
    ds_smem,
    dq_smem,
    bars,
    b,
    h0,
    hkv,
    n0,
    j_lo,
    n_qblocks,
    n_iter,
    first_full,
    dk_ptr,
    dv_ptr,
    dk_strides,
    dv_strides,
    dk_part,
    dv_part,
    part_size,
    counts,
    n_q,
    n_k,
    heads,
    heads_q,
    group,
    qk_scale,
    scale,
    HALF: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    GROUP_SUM: gl.constexpr,
    FUSE_DQ: gl.constexpr,
):
    """One warpgroup: dK and dV of keys [n0 + HALF * 64, +64) over the loader's steps; query blocks before
    ``first_full`` are masked. Writes them to rows of dk_ptr and dv_ptr by their (batch, head, row) strides,
    or, when the program has part of a GQA group's query heads, as GROUP_SUM says (``hopper_dkdv_kernel``)."""
    kv_ready, q_ready, do_ready, free, ds_ready, dq_full, dq_empty = bars
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = k_desc.dtype
    st_layout: gl.constexpr = warpgroup_layout(BLOCK_M)
    acc_layout: gl.constexpr = warpgroup_layout(HEAD_DIM)
    dq_layout: gl.constexpr = warpgroup_layout(HEAD_DIM // 2)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    columns: gl.constexpr = gl.SliceLayout(0, st_layout)

    k = k_smem.index(HALF).reshape([ROWS, HEAD_DIM])
    v = v_smem.index(HALF).reshape([ROWS, HEAD_DIM])
    key_pos = gl.expand_dims(n0 + HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout)), 1)
    no_scores = gl.zeros([ROWS, BLOCK_M], gl.float32, st_layout)
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    no_dq = gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, dq_layout)
    key_bound = n0 + 2 * ROWS > n_k  # the block has keys past Nk: TMA's zero rows, whose weights are not 0
    mbarrier.wait(kv_ready.index(HALF), 0)

    for t in range(n_iter):
        stage = t % STAGES
        phase = (t // STAGES) & 1
        j = j_lo + t % n_qblocks
        query = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=columns)
        mbarrier.wait(q_ready.index(stage), phase)
        q = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
        st = warpgroup_mma(k, q.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        do = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
        dpt = warpgroup_mma(v, do.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        lse_t = lse_smem.index(stage).load(columns)
        st, _, _ = warpgroup_mma_wait(1, deps=(st, k, q))  # Sᵀ done; dPᵀ may still run
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse_t, 0))  # one fused multiply-add a score
        if CAUSAL:
            if j < first_full:  # some pair of this step is masked
                pt = gl.where(_keep(key_pos, query, n_q, n_k), pt, 0.0)
        delta_t = delta_smem.index(stage).load(columns)
        dpt, _, _ = warpgroup_mma_wait(0, deps=(dpt, v, do))
        dst = pt * (dpt - gl.expand_dims(delta_t, 0))
        if CAUSAL:
            if j < first_full:  # the mask again: cheaper than keeping it live across the dPᵀ wait
                dst = gl.where(_keep(key_pos, query, n_q, n_k), dst, 0.0)
        if FUSE_DQ:
            if key_bound:  # dQ sums dS over all 128 keys: a zero key's weight must be 0, not exp(-lse)
                dst = gl.where(key_pos < n_k, dst, 0.0)
        ds = dst.to(dtype)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do, dv, is_async=True)
        if FUSE_DQ:
            dq = _dq_half(ds, ds_smem, k_smem, ds_ready, no_dq, t, HALF)
        dk = warpgroup_mma(gl.convert_layout(ds, op_layout), q, dk, is_async=True)
        if FUSE_DQ:
            dv, dq, _, _ = warpgroup_mma_wait(1, deps=(dv, dq, do, ds_smem))
            mbarrier.wait(dq_empty.index(HALF), (t & 1) ^ 1)  # the reducer has read this half's last tile
            dq_smem.index(HALF).reshape([BLOCK_M, HEAD_DIM // 2]).store(dq * scale)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(dq_full.index(HALF), count=1)
            dk, _ = warpgroup_mma_wait(0, deps=(dk, q))
        else:
            dv, dk, _, _ = warpgroup_mma_wait(0, deps=(dv, dk, do, q))
        mbarrier.arrive(free.index(stage), count=1)

    dk = dk * scale
    key = gl.expand_dims(n0 + HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout)), 1)
    d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout)), 0)
    store_program_grads(
        dk, dv, dk_ptr, dv_ptr, dk_strides, dv_strides, dk_part, dv_part, part_size, counts, key, d, b, h0, hkv, n0,
        n_k, heads, heads_q, group, HALF, GROUP_SUM,
    )  # fmt: skip


@gluon.jit
def hopper_dkdv_kernel(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    lse_desc,
    delta_desc,
    dk,
    dv,
    dq_desc,
    dk_part,
    dv_part,
    part_size,
    counts,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    n_q,
    n_k,
    heads_q,
    group,
    heads,
    row_stride,
    qk_scale,
    scale,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    GROUP_SUM: gl.constexpr,
    FUSE_DQ: gl.constexpr,
):
    """q_desc, do_desc: (B, Hq, Nq, D) in [1, 1, BLOCK_M, D] tiles; k_desc, v_desc: (B, Hkv, Nk, D) in
    [1, 1, 64, D] tiles; lse_desc, delta_desc: the rows' lse₂ and delta (``template_rows.py``), float32
    (B * Hq * row_stride,), each (batch, head)'s row_stride values (Nq padded to whole BLOCK_M tiles), in
    [BLOCK_M] tiles; dk, dv: (B, Hkv, Nk, D) with a unit last stride. With FUSE_DQ, dq_desc: dQ's float32
    accumulator (B, Hq, Nq, D) in [1, 1, BLOCK_M, D / 2] tiles, zeros or a sum to add to (else None).
    qk_scale: the scores' factor in log2 units; scale: the program's.
    Grid (B * Hq / heads, cdiv(Nk, 128)), the blocks that most queries see first: a program takes ``heads``
    query heads of a GQA group (a divisor of it). With all of them (GROUP_SUM "none") it stores dK and dV;
    else they are summed over the group's programs, as GROUP_SUM says:
    - "atomic": each adds its float32 shares into dk_part and dv_part, float32 zeros (B, Hkv, Nk, D); the
      order of the adds, so the sums' last bits, vary from run to run;
    - "last": each stores them in its part of dk_part and dv_part, float32 (group / heads, B, Hkv, Nk, D)
      with part_size elements a part, and counts them in counts, int32 zeros, one per 64-key tile
      (B * Hkv * 2 * cdiv(Nk, 128)); the last program to finish sums the parts in order and stores dK, dV.
    4 warps (one consumer) plus the workers: a consumer, the loader and dQ's reducer."""
    bh = gl.program_id(0)
    n0 = gl.program_id(1) * (2 * ROWS)
    b = bh // (heads_q // heads)
    h0 = bh % (heads_q // heads) * heads
    hkv = h0 // group
    if CAUSAL:  # query row r keeps key c when c <= r + Nk - Nq
        j_lo = gl.maximum(n0 - (n_k - n_q), 0) // BLOCK_M
        first_full = gl.cdiv(gl.maximum(n0 + 2 * ROWS - 1 - (n_k - n_q), 0), BLOCK_M)
    else:
        j_lo = 0
        first_full = 0
    n_qblocks = gl.cdiv(n_q, BLOCK_M) - j_lo
    n_iter = heads * n_qblocks

    q_smem, do_smem, q_ready, do_ready, free = ring(q_desc, do_desc, STAGES)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
    if FUSE_DQ:  # both halves of two steps' dSᵀ, and the tiles of dQ's halves
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_M], k_desc.dtype)
        ds_smem = gl.allocate_shared_memory(k_desc.dtype, [4, ROWS, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [2] + dq_desc.block_type.shape, dq_desc.layout)
    else:  # unused
        ds_smem = k_smem
        dq_smem = k_smem
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ds_ready, count=2)  # both consumers
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    bars = (kv_ready, q_ready, do_ready, free, ds_ready, dq_full, dq_empty)
    dk_strides = (stride_dkb, stride_dkh, stride_dkn)
    dv_strides = (stride_dvb, stride_dvh, stride_dvn)
    # The argument tuples are written out: a tuple built by concatenation loses its constexprs.
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    k_desc,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    ds_smem,
                    dq_smem,
                    bars,
                    b,
                    h0,
                    hkv,
                    n0,
                    j_lo,
                    n_qblocks,
                    n_iter,
                    first_full,
                    dk,
                    dv,
                    dk_strides,
                    dv_strides,
                    dk_part,
                    dv_part,
                    part_size,
                    counts,
                    n_q,
                    n_k,
                    heads,
                    heads_q,
                    group,
                    qk_scale,
                    scale,
                    0,
                    BLOCK_M,
                    STAGES,
                    CAUSAL,
                    GROUP_SUM,
                    FUSE_DQ,
                ),
            ),
            (
                _consumer,
                (
                    k_desc,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    ds_smem,
                    dq_smem,
                    bars,
                    b,
                    h0,
                    hkv,
                    n0,
                    j_lo,
                    n_qblocks,
                    n_iter,
                    first_full,
                    dk,
                    dv,
                    dk_strides,
                    dv_strides,
                    dk_part,
                    dv_part,
                    part_size,
                    counts,
                    n_q,
                    n_k,
                    heads,
                    heads_q,
                    group,
                    qk_scale,
                    scale,
                    1,
                    BLOCK_M,
                    STAGES,
                    CAUSAL,
                    GROUP_SUM,
                    FUSE_DQ,
                ),
            ),
            (
                _loader,
                (
                    q_desc,
                    do_desc,
                    k_desc,
                    v_desc,
                    lse_desc,
                    delta_desc,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    bars,
                    b,
                    h0,
                    hkv,
                    n0,
                    j_lo,
                    n_qblocks,
                    n_iter,
                    row_stride,
                    heads_q,
                    BLOCK_M,
                    STAGES,
                ),
            ),
            (_reducer, (dq_desc, dq_smem, bars, b, h0, j_lo, n_qblocks, n_iter, BLOCK_M, FUSE_DQ)),
        ],
        [4, 1, 1],
        [240, 24, 24],
    )
