"""What every instance of the Hopper templates shares, in Gluon: the accumulator layouts, the shared-memory
ring that a loader warp fills through TMA, and the forward's loader.

The forward's program is one block of ``2 * ROWS`` query rows of one (batch, query head): two consumer
warpgroups take ``ROWS`` rows each, and a loader warp streams the key blocks they visit through ``STAGES``
shared-memory stages. A stage is free again once both consumers have read it.
"""

from __future__ import annotations

from ..triton_compat import gl, gluon, mbarrier, tma

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup; a forward program's block is 2 * ROWS
CAREFUL_COLUMNS = gl.constexpr(64)  # out's columns per careful redo: its registers stay few at any head dim
CONSUMER_REGISTERS = 240  # registers per thread of each consumer warpgroup (setmaxnreg)
LOADER_REGISTERS = 24  # and of the loader warp
LAUNCH_REGISTERS = 168  # the kernel's cap at entry, which setmaxnreg redistributes: (2 * 240 + 24) / 3


@gluon.constexpr_function
def warpgroup_layout(columns):
    """The register layout of one warpgroup's [ROWS, columns] wgmma accumulator."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16])


@gluon.jit
def ring(a_desc, b_desc, STAGES: gl.constexpr):
    """Shared memory for two tensors' tiles streamed through ``STAGES`` stages: the tiles of each, a ready
    barrier per stage for each (TMA completes it), and a free barrier per stage that both consumers arrive on."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)  # both consumers
    return a_smem, b_smem, a_ready, b_ready, free


@gluon.jit
def query_tiles(q_desc):
    """Shared memory for a program's two Q tiles (a consumer's out tile is staged there too) and their
    ready barriers."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
    return q_smem, q_ready


@gluon.jit
def forward_loader(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, b, h, hk, m0, start, n_steps, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: the two Q tiles of rows m0.., then key block j (keys start + j * BLOCK_N..) into stage
    j % STAGES once both consumers freed it. TMA fills rows past a tensor's end with zeros."""
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
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, key, 0], v_ready.index(stage), v_smem.index(stage))
