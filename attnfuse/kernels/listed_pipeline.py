"""The forward template's loads for a program whose mask lists its blocks (block sparsity), in Gluon.

An instance of such a program writes its own loader warp (``kernels/forward.py``): it reads the mask's list
with the plugin's fragments, and each step's key block comes through ``load_key_block`` into the ring of
``pipeline.ring``, on the protocol of ``pipeline.forward_loader`` (a stage is refilled once both consumers
freed it).
"""

from __future__ import annotations

from ..triton_compat import gl, gluon, mbarrier, tma
from .pipeline import ROWS


@gluon.jit
def load_query_tiles(q_desc, q_smem, q_ready, b, h, m0):
    """The program's two Q tiles, rows m0.. (2 * ROWS), each on its ready barrier."""
    for half in gl.static_range(2):
        mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + half * ROWS, 0], q_ready.index(half), q_smem.index(half))


@gluon.jit
def load_key_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, b, hk, key, j, STAGES: gl.constexpr):
    """Step ``j``: the K and V tiles of keys key.. (the descriptors' rows) into stage j % STAGES, once both
    consumers freed it. TMA fills rows past the tensor's end with zeros."""
    stage = j % STAGES
    mbarrier.wait(kv_free.index(stage), ((j // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, key, 0], k_ready.index(stage), k_smem.index(stage))
    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [b, hk, key, 0], v_ready.index(stage), v_smem.index(stage))
