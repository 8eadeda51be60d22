"""What every dK/dV kernel on Hopper shares, in Gluon: the loader warp of the dK/dV template, and the stores of
a program's dK and dV (summed over a GQA group's programs when its query heads are split over several), which
the hand-written dK/dV kernel (``runtime/hopper_dkdv_kernel.py``) uses too.

A dK/dV program is one block of ``2 * ROWS`` keys of one (batch, kv head): two consumer warpgroups take ``ROWS``
keys each, and a loader warp streams the query blocks that see them (Q and dO tiles, with their rows' lse and
delta where the normaliser reads them) through ``STAGES`` shared-memory stages.
"""

from __future__ import annotations

from ..triton_compat import gl, gluon, mbarrier, tma
from .pipeline import ROWS


@gluon.jit
def program_coordinates(pid_bh, heads_q, heads, group):
    """A dK/dV program's batch, first query head and kv head, from its index pid_bh in the grid's first axis
    (B * heads_q / heads programs, each of ``heads`` query heads of a GQA group of ``group``)."""
    b = pid_bh // (heads_q // heads)
    h0 = pid_bh % (heads_q // heads) * heads
    return b, h0, h0 // group


@gluon.jit
def opaque(x):
    """int32 ``x`` through an inline PTX move that neither LLVM nor ptxas looks through or moves (not pure): what
    is derived from it is computed where it is used. A consumer passes its step's scalars (first key, Nq, Nk) to
    the functions that evaluate a step part by part through it, and reads its program's coordinates after the
    step loop through it; else the compilers hoist the per-thread positions and keep the coordinates from the
    program's entry, above the partition's ``setmaxnreg``, in registers the step loop needs, and ptxas spilled
    them at head dim 128 (ALiBi, the block masks)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def dkdv_loader(
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
    bars, b, h0, hkv, n0, j_lo, n_qblocks, n_iter, q0, k0, r0, row_stride, heads_q, BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr, HAS_LSE: gl.constexpr, HAS_DELTA: gl.constexpr,
):  # fmt: skip
    """One warp: both halves' K and V tiles, then step t's Q tile (with its rows' lse, HAS_LSE) and dO tile
    (with their delta, HAS_DELTA) into stage t % STAGES once both consumers freed it. Step t is query block
    j_lo + t % n_qblocks of query head h0 + t // n_qblocks. Query block j and key n0 are rows q0 + j * BLOCK_M
    and k0 + n0 of the tensors, and query block j's lse and delta start at r0 + j * BLOCK_M of a head's rows (a
    packed document's first rows, r0 a multiple of BLOCK_M; 0, 0, 0 otherwise). TMA fills rows past a tensor's
    end with zeros."""
    kv_ready, q_ready, do_ready, free = bars
    for half in gl.static_range(2):
        mbarrier.expect(kv_ready.index(half), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        key = k0 + n0 + half * ROWS
        tma.async_copy_global_to_shared(k_desc, [b, hkv, key, 0], kv_ready.index(half), k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [b, hkv, key, 0], kv_ready.index(half), v_smem.index(half))
    for t in range(n_iter):
        stage = t % STAGES
        h = h0 + t // n_qblocks
        m = (j_lo + t % n_qblocks) * BLOCK_M
        mbarrier.wait(free.index(stage), ((t // STAGES) & 1) ^ 1)
        row = (b * heads_q + h) * row_stride + r0 + m  # in lse's and delta's flat rows
        if HAS_LSE:
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(lse_desc, [row], q_ready.index(stage), lse_smem.index(stage))
        else:
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, q0 + m, 0], q_ready.index(stage), q_smem.index(stage))
        if HAS_DELTA:
            mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(delta_desc, [row], do_ready.index(stage), delta_smem.index(stage))
        else:
            mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, h, q0 + m, 0], do_ready.index(stage), do_smem.index(stage))


@gluon.jit
def sum_shares(dk, dv, dk_part, dv_part, part_size, count, rows, keep, part, parts):
    """Stores this program's float32 shares of dK and dV (64 keys, D) at ``rows`` (where ``keep``) of part
    ``part`` of dk_part and dv_part (``parts`` parts of part_size elements, each (B, Hkv, Nk, D)), and
    counts them in ``count``, its tile's zeroed counter. Returns the group's sums, in part order
    (deterministic), and whether this program is the last of its group, the one that stores them. Of two
    parts the last adds the other's shares to its own, in registers: a + b is b + a, bit for bit."""
    mine = part.to(gl.int64) * part_size + rows
    gl.store(dk_part + mine, dk, mask=keep)
    gl.store(dv_part + mine, dv, mask=keep)
    gl.thread_barrier()  # every thread's stores before the count that publishes them
    last = gl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == parts - 1
    if last:
        if parts == 2:
            other = (1 - part).to(gl.int64) * part_size + rows
            dk += gl.load(dk_part + other, mask=keep, other=0.0, cache_modifier=".cg")
            dv += gl.load(dv_part + other, mask=keep, other=0.0, cache_modifier=".cg")
        else:
            dk = gl.zeros_like(dk)
            dv = gl.zeros_like(dv)
            for j in range(parts):
                dk += gl.load(dk_part + j * part_size + rows, mask=keep, other=0.0, cache_modifier=".cg")
                dv += gl.load(dv_part + j * part_size + rows, mask=keep, other=0.0, cache_modifier=".cg")
    return dk, dv, last


@gluon.jit
def store_grads(dk, dv, dk_ptr, dv_ptr, dk_strides, dv_strides, key, d, b, hkv, n_k):
    """Stores dK and dV (64 keys, D) at key rows ``key`` (below Nk) of kv head hkv, in the outputs' dtypes."""
    gl.store(
        dk_ptr
        + b.to(gl.int64) * dk_strides[0]
        + hkv.to(gl.int64) * dk_strides[1]
        + key.to(gl.int64) * dk_strides[2]
        + d,
        dk.to(dk_ptr.dtype.element_ty),
        mask=key < n_k,
    )
    gl.store(
        dv_ptr
        + b.to(gl.int64) * dv_strides[0]
        + hkv.to(gl.int64) * dv_strides[1]
        + key.to(gl.int64) * dv_strides[2]
        + d,
        dv.to(dv_ptr.dtype.element_ty),
        mask=key < n_k,
    )


@gluon.jit
def store_program_grads(
    dk, dv, dk_ptr, dv_ptr, dk_strides, dv_strides, dk_part, dv_part, part_size, counts, key, d, b, h0, hkv, n0,
    n_k, heads, heads_q, group, HALF: gl.constexpr, GROUP_SUM: gl.constexpr,
):  # fmt: skip
    """One consumer's dK and dV (keys ``key`` = n0 + HALF * 64.., head dims ``d``): stored when its program has
    all of the group's query heads (GROUP_SUM "none"), else summed over the group's programs, as GROUP_SUM
    says ("atomic": float32 adds into dk_part and dv_part; "last": ``sum_shares``)."""
    HEAD_DIM: gl.constexpr = dk.shape[1]
    if GROUP_SUM == "none":
        store_grads(dk, dv, dk_ptr, dv_ptr, dk_strides, dv_strides, key, d, b, hkv, n_k)
    else:  # a split group: these rows of its float32 (B, Hkv, Nk, D) sums, or of each part's shares
        kv_row = b * (heads_q // group) + hkv
        rows = (kv_row.to(gl.int64) * n_k + key) * HEAD_DIM + d
        if GROUP_SUM == "atomic":
            gl.atomic_add(dk_part + rows, dk, mask=key < n_k, sem="relaxed")
            gl.atomic_add(dv_part + rows, dv, mask=key < n_k, sem="relaxed")
        else:  # "last": this part's shares; the group's last program to finish sums them all
            tile = kv_row * (2 * gl.cdiv(n_k, 2 * ROWS)) + n0 // ROWS + HALF  # this 64-key tile's counter
            dk, dv, last = sum_shares(
                dk, dv, dk_part, dv_part, part_size, counts + tile, rows, key < n_k, h0 % group // heads, group // heads
            )
            if last:
                store_grads(dk, dv, dk_ptr, dv_ptr, dk_strides, dv_strides, key, d, b, hkv, n_k)
