"""What a float8 instance (e4m3 or e5m2) of the forward template reads differently: float8 ``wgmma`` takes both operands
K-major from shared memory, so P·V multiplies by V transposed. The launch (``launch_fp8.py``) makes that copy,
(B, Hkv, DV, Nk rounded up to KEY_CHUNK), its keys permuted within each chunk as P's columns are
(``fp8_weights``); the loader streams it in [1, 1, DV, BLOCK_N] tiles, and the careful redo reads V's rows from
it. Q and K stream as ``pipeline.forward_loader`` streams them."""

from __future__ import annotations

from ..triton_compat import gl, gluon, mbarrier, tma
from .pipeline import ROWS


@gluon.constexpr_function
def warpgroup_layout_fp8(columns):
    """The register layout of one warpgroup's [ROWS, columns] accumulator of float8 ``wgmma`` (32 terms an
    instruction)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 32])


@gluon.jit
def forward_loader_fp8(
    q_desc, k_desc, vt_desc, q_smem, k_smem, vt_smem, bars, b, h, hk, m0, start, n_steps, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: the two Q tiles of rows m0.., then key block j (keys start + j * BLOCK_N..: K's rows, Vᵀ's
    columns) into stage j % STAGES once both consumers freed it. TMA fills what lies past a tensor's end with
    zeros."""
    q_ready, k_ready, v_ready, kv_free = bars
    for half in gl.static_range(2):
        mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + half * ROWS, 0], q_ready.index(half), q_smem.index(half))
    for j in range(n_steps):
        stage = j % STAGES
        key = start + j * BLOCK_N
        mbarrier.wait(kv_free.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, key, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), vt_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(vt_desc, [b, hk, 0, key], v_ready.index(stage), vt_smem.index(stage))


# P·V takes P times this: weights at most 1 (``NormaliserFragment.unit_weights``) then round with e4m3's relative
# error down to 2⁻¹⁴ (its normal range starts at 2⁻⁶) and stay within its range (448); out is divided by it again
P_SCALE = gl.constexpr(256.0)
KEY_CHUNK = gl.constexpr(32)  # the keys one float8 wgmma sums: P's columns and Vᵀ's are permuted within each chunk


@gluon.jit
def fp8_weights(p):
    """P · P_SCALE rounded to float8 e4m3 (saturated, should a weight pass 448 / P_SCALE), its columns
    permuted within each KEY_CHUNK as ``stored_key`` stores V's keys, so that the accumulator's registers are
    already P·V's register operand: a thread holds columns 8·a + 2·c + e of the accumulator and 4·c + e' + 16·a'
    of the operand (c: its lane within a row's four; e, e' < 2 and 4), so the columns 16·a1 + 8·a0 + 2·c + e
    move to 16·a1 + 4·c + 2·a0 + e and no value leaves its thread."""
    weights = (p * P_SCALE).to(gl.float8e4nv)
    M: gl.constexpr = weights.shape[0]
    N: gl.constexpr = weights.shape[1]
    split = weights.reshape([M, N // KEY_CHUNK, 2, 2, 4, 2])  # (a1, a0, c, e) of each chunk's columns
    return split.permute((0, 1, 2, 4, 3, 5)).reshape([M, N])


@gluon.jit
def stored_key(n):
    """The column of Vᵀ's copy that holds key n (``fp8_weights``' permutation; ``launch_fp8.transposed_values``)."""
    return (n & ~15) | ((n & 6) << 1) | ((n & 8) >> 2) | (n & 1)


@gluon.jit
def load_value_rows(
    ptr, vt_desc, b, h, first, n_rows, ROWS_: gl.constexpr, layout: gl.constexpr, C0: gl.constexpr,
    COLUMNS: gl.constexpr,
):  # fmt: skip
    """V's rows [first, first + ROWS_), columns [C0, C0 + COLUMNS) at (b, h), in ``layout``, read from its
    transposed copy ``ptr`` (B, H, DV, N rounded up to KEY_CHUNK; key n in column ``stored_key(n)``) through
    ``vt_desc``'s strides; rows past n_rows read 0."""
    r = gl.expand_dims(first + gl.arange(0, ROWS_, layout=gl.SliceLayout(1, layout)), 1)
    d = gl.expand_dims(C0 + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout)), 0)
    offsets = (
        b.to(gl.int64) * vt_desc.strides[0]
        + h.to(gl.int64) * vt_desc.strides[1]
        + d.to(gl.int64) * vt_desc.strides[2]
        + stored_key(r)
    )
    return gl.load(ptr + offsets, mask=r < n_rows, other=0.0)
