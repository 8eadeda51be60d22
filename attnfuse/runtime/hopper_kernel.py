"""The Hopper forward template, in Gluon: softmax attention with a causal mask or none, warp-specialised.

One program per (128-query block, batch x query head). A loader warp brings the block's two 64-row Q tiles
and then each K and V block through TMA into a ring of ``STAGES`` shared-memory stages; two consumer
warpgroups take 64 query rows each and free a stage when both have read it. A consumer issues block i's
QKᵀ before block i-1's P·V, so its softmax of block i runs while the tensor cores multiply; the two
consumers are not in lockstep, so one's softmax can also run under the other's matmuls. TMA reads only
inside the tensors' shapes (it fills the rest of a tile with zeros) and writes only inside out's.

Scores are ``q·kᵀ · qk_scale`` in log2 units (the program's scale times log2(e), positive), so exp2 is exact
exp. The running max is kept on the unscaled ``q·kᵀ`` and the factor applied inside the exponent, one fused
multiply-add a score (``exp2(s · qk_scale − max · qk_scale)``), as FlashAttention-3 does.
"""

from __future__ import annotations

from ..kernels.pipeline import ROWS, ring, warpgroup_layout
from ..kernels.rows import load_rows, load_rows_t, row_offsets
from ..triton_compat import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    mma_v2,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

CAREFUL_KEYS = gl.constexpr(16)  # keys per step of the careful redo


@gluon.jit
def _loader(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    bars,
    b,
    hq,
    hkv,
    m0,
    n_blocks,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: the Q tiles, then K and V block i into stage i % STAGES once both consumers freed it."""
    q_ready, k_ready, v_ready, kv_free = bars
    for half in gl.static_range(2):
        mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, hq, m0 + half * ROWS, 0], q_ready.index(half), q_smem.index(half))
    for i in range(n_blocks):
        stage = i % STAGES
        mbarrier.wait(kv_free.index(stage), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hkv, i * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hkv, i * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _max_offset(m, qk_scale):
    """What the weights' exponents subtract: a rows' max ``m`` of q·kᵀ in log2 units, 0 where the row has kept
    no key yet (max -inf)."""
    return gl.where(m == float("-inf"), 0.0, m * qk_scale)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """One block of the online softmax, s = q·kᵀ (rows, keys) with masked scores -inf: the block's weights
    p, the factor alpha of the rows' earlier sums, and the new running max (of q·kᵀ) and sum (a row that has
    kept no key yet keeps max -inf and weights 0)."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    offset = _max_offset(m_new, qk_scale)
    alpha = gl.exp2(m_i * qk_scale - offset)
    p = gl.exp2(s * qk_scale - gl.expand_dims(offset, 1))
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _lse(m_i, l_i, qk_scale):
    """The rows' natural-log sum of exp (-inf where a row kept no key, l_i 0), from their max of q·kᵀ and
    their sum of weights."""
    return gl.where(
        l_i == 0.0, float("-inf"), (m_i * qk_scale + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453
    )


@gluon.jit
def _masked(s, i, row_pos, n_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    """Scores (64, BLOCK_N) of key block i with keys past n_k, and (causal) past each row's position, -inf."""
    k_pos = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    keep = gl.expand_dims(k_pos < n_k, 0)
    if CAUSAL:
        keep = keep & (gl.expand_dims(k_pos, 0) <= gl.expand_dims(row_pos, 1))
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _careful(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    lse_row,
    b,
    hq,
    hkv,
    first,
    n_q,
    n_k,
    n_seen,
    qk_scale,
    CAUSAL: gl.constexpr,
    SAVE_LSE: gl.constexpr,
):
    """The redo of rows [first, first + 64) when the fast loop's accumulator is not finite: a masked key's
    NaN or inf value reached it as 0 · NaN (or a kept key's did, or a sum overflowed). Keys [0, n_seen) are
    read again from global memory, CAREFUL_KEYS at a time, and multiplied in registers (mma.sync) with
    their non-finite values as 0; out[r, c] is NaN where row r keeps a key whose value in column c is not
    finite, as the math's is. Writes out and lse itself. Rare: only non-finite inputs or overflowing sums
    get here, so it is small rather than fast."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, mma)

    q = load_rows(q_ptr, q_desc, b, hq, first, n_q, ROWS, a_op)
    row = first + gl.arange(0, ROWS, layout=rows)
    row_pos = row + (n_k - n_q)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows)
    l_i = gl.zeros([ROWS], gl.float32, rows)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma)
    poisoned = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma)  # kept keys with a non-finite value, by column
    for start in range(0, n_seen, CAREFUL_KEYS):
        k_t = load_rows_t(k_ptr, k_desc, b, hkv, start, n_k, CAREFUL_KEYS, b_op)
        s = mma_v2(q, k_t, gl.zeros([ROWS, CAREFUL_KEYS], gl.float32, mma))
        k_pos = start + gl.arange(0, CAREFUL_KEYS, layout=gl.SliceLayout(0, mma))
        keep = gl.expand_dims(k_pos < n_k, 0) & gl.expand_dims(row < n_q, 1)  # (64, CAREFUL_KEYS)
        if CAUSAL:
            keep = keep & (gl.expand_dims(k_pos, 0) <= gl.expand_dims(row_pos, 1))
        p, alpha, m_i, l_i = _softmax_step(gl.where(keep, s, float("-inf")), m_i, l_i, qk_scale)
        v = load_rows(v_ptr, v_desc, b, hkv, start, n_k, CAREFUL_KEYS, b_op)
        finite = gl.abs(v.to(gl.float32)) < float("inf")  # false for NaN too
        poisoned = mma_v2(
            gl.convert_layout(gl.where(keep, 1.0, 0.0).to(dtype), a_op), gl.where(finite, 0.0, 1.0).to(dtype), poisoned
        )
        acc = mma_v2(
            gl.convert_layout(p.to(dtype), a_op), gl.where(finite, v, 0.0).to(dtype), acc * gl.expand_dims(alpha, 1)
        )
    l_use = gl.where(l_i == 0.0, 1.0, l_i)
    out = gl.where(poisoned > 0.0, float("nan"), acc / gl.expand_dims(l_use, 1))
    if SAVE_LSE:
        gl.store(lse_row + row, _lse(m_i, l_i, qk_scale), mask=row < n_q)
    d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma)), 0)
    gl.store(
        o_ptr + row_offsets(o_desc, b, hq, gl.expand_dims(row, 1), d), out.to(dtype), mask=gl.expand_dims(row < n_q, 1)
    )


@gluon.jit
def _consumer(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    bars,
    b,
    hq,
    hkv,
    m0,
    n_blocks,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    o_desc,
    lse_row,
    n_q,
    n_k,
    qk_scale,
    first_masked,
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    HALF: gl.constexpr,
    CAUSAL: gl.constexpr,
    SAVE_LSE: gl.constexpr,
):
    """One warpgroup: rows [m0 + HALF * 64, +64) over key blocks [0, n_blocks); blocks from
    ``first_masked`` on are masked. Writes its out rows (through its Q tile's shared memory) and lse, or,
    when its accumulator is not finite, has ``_careful`` redo them."""
    q_ready, k_ready, v_ready, kv_free = bars
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = warpgroup_layout(BLOCK_N)
    o_layout: gl.constexpr = warpgroup_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    q = q_smem.index(HALF).reshape([ROWS, HEAD_DIM])
    row = m0 + HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    row_pos = row + (n_k - n_q)  # bottom-right aligned: the last query sees the last key
    no_scores = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready.index(HALF), 0)

    # Block 0: its weights; its P·V is issued in the next step, under block 1's softmax.
    mbarrier.wait(k_ready.index(0), 0)
    k = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM])
    s = warpgroup_mma(q, k.permute((1, 0)), no_scores, use_acc=False)
    if first_masked == 0:
        s = _masked(s, 0, row_pos, n_k, BLOCK_N, CAUSAL, s_layout)
    m_i = gl.max(s, 1)
    p = gl.exp2(s * qk_scale - gl.expand_dims(_max_offset(m_i, qk_scale), 1))
    l_i = gl.sum(p, 1)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    for i in range(1, n_blocks):
        stage = i % STAGES
        prev = (i - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (i // STAGES) & 1)
        k = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
        s_next = warpgroup_mma(q, k.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
        v = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v, acc, is_async=True)
        s, _, _ = warpgroup_mma_wait(1, deps=(s_next, q, k))  # QKᵀ done; P·V may still run
        if i >= first_masked:
            s = _masked(s, i, row_pos, n_k, BLOCK_N, CAUSAL, s_layout)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        acc, _ = warpgroup_mma_wait(0, deps=(acc, v))
        mbarrier.arrive(kv_free.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)

    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    v = v_smem.index(last).reshape([BLOCK_N, HEAD_DIM])
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v, acc)
    mbarrier.arrive(kv_free.index(last), count=1)

    if gl.max(gl.max(gl.where(gl.abs(acc) < float("inf"), 0, 1), 1), 0) > 0:  # NaN too
        _careful(
            q_ptr,
            k_ptr,
            v_ptr,
            o_ptr,
            q_desc,
            k_desc,
            v_desc,
            o_desc,
            lse_row,
            b,
            hq,
            hkv,
            m0 + HALF * ROWS,
            n_q,
            n_k,
            n_blocks * BLOCK_N,
            qk_scale,
            CAUSAL,
            SAVE_LSE,
        )
    else:
        # A row with no key kept has l_i 0: out 0, lse -inf (as the softmax plugin's reference).
        l_use = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.expand_dims(gl.convert_layout(l_use, o_rows), 1)
        if SAVE_LSE:
            gl.store(lse_row + row, _lse(m_i, l_i, qk_scale), mask=row < n_q)
        q.store(out.to(dtype))  # the Q tile is read: stage out there
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, hq, m0 + HALF * ROWS, 0], q_smem.index(HALF))
        tma.store_wait(0)


@gluon.jit
def hopper_forward_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    q,
    k,
    v,
    out,
    lse,
    n_q,
    n_k,
    heads_q,
    group,
    qk_scale,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    SAVE_LSE: gl.constexpr,
):
    """q_desc, o_desc: (B, Hq, Nq, D) in [1, 1, 64, D] tiles; k_desc, v_desc: (B, Hkv, Nk, D) in
    [1, 1, BLOCK_N, D] tiles; q, k, v, out: the same tensors' pointers (the careful redo reads and writes
    through them, with the descriptors' strides); lse (B, Hq, Nq) float32 (natural log), written if SAVE_LSE.
    Grid (B * Hq, cdiv(Nq, 128)), so every head's longest causal rows start first; 4 warps (one consumer)
    plus the workers: a consumer and the loader."""
    bh = gl.program_id(0)
    m0 = (gl.num_programs(1) - 1 - gl.program_id(1)) * (2 * ROWS)
    b = bh // heads_q
    hq = bh % heads_q
    hkv = hq // group
    if CAUSAL:
        n_seen = gl.minimum(n_k, m0 + 2 * ROWS + n_k - n_q)
        first_masked = gl.maximum(m0 + n_k - n_q, 0) // BLOCK_N  # blocks before it: every row keeps them
    else:
        n_seen = n_k
        first_masked = n_k // BLOCK_N  # only a last, partial block needs the mask
    n_blocks = gl.maximum(gl.cdiv(n_seen, BLOCK_N), 1)  # at least one, so rows with no key get 0 and -inf

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
    k_smem, v_smem, k_ready, v_ready, kv_free = ring(k_desc, v_desc, STAGES)
    bars = (q_ready, k_ready, v_ready, kv_free)
    lse_row = lse + bh.to(gl.int64) * n_q
    # The argument tuples are written out: a tuple built by concatenation loses its constexprs.
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    k_smem,
                    v_smem,
                    bars,
                    b,
                    hq,
                    hkv,
                    m0,
                    n_blocks,
                    BLOCK_N,
                    STAGES,
                    o_desc,
                    lse_row,
                    n_q,
                    n_k,
                    qk_scale,
                    first_masked,
                    q,
                    k,
                    v,
                    out,
                    0,
                    CAUSAL,
                    SAVE_LSE,
                ),
            ),
            (
                _consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    k_smem,
                    v_smem,
                    bars,
                    b,
                    hq,
                    hkv,
                    m0,
                    n_blocks,
                    BLOCK_N,
                    STAGES,
                    o_desc,
                    lse_row,
                    n_q,
                    n_k,
                    qk_scale,
                    first_masked,
                    q,
                    k,
                    v,
                    out,
                    1,
                    CAUSAL,
                    SAVE_LSE,
                ),
            ),
            (
                _loader,
                (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, b, hq, hkv, m0, n_blocks, BLOCK_N, STAGES),
            ),
        ],
        [4, 1],
        [240, 24],
    )
