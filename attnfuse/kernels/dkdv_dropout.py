"""A dK/dV step's dropout mask, regenerated into shared memory before the step's products (``kernels/dkdv.py``).

Regenerated in the chain on the whole (64 x 64) tile, beside the step's scores, dP, dK and dV, the mask's ten
Philox rounds made ptxas spill the step loop (a few hundred bytes at head dim 64, about a thousand at 128). So an
instance with attention dropout regenerates a step's mask first, while only dK and dV are live, 16 rows at a time
(in ``PART`` a thread holds 8 weights, a group that shares one Philox draw), into a 64 x 64 tile of
shared memory per consumer warpgroup (after its P and dS tiles in ``pds_smem``); the chain reads it there
(``CHAIN``), for dP and for the weights dV reads. The numbers are the forward's (``passes/codegen/dropout.keep``).
"""

from __future__ import annotations

import string

from ..passes.codegen.dropout import dropout_setup, keep
from ..passes.lower import LoweredProgram
from ..plan import DROPOUT_P, DROPOUT_STATE
from .dkdv_keep import STEP_SCALARS

CHAIN = "drop_keep = drop_tile.load(S_LAYOUT) != 0  # the forward's mask, as the step regenerated it (dkdv_dropout)"

_FUNCTION = string.Template('''
@gluon.jit
def ${name}_drop(drop_tile, start_m, k0, Nq, N_K, HQ, b, h, ${state}, ${p}):
    """The forward's dropout mask of a step's (64 x 64) tile, rows start_m.. and keys k0.. of query head h, into
    drop_tile (1 where a weight is kept, in its dtype), 16 rows at a time; the seed and counter offset read here
    (held in the consumer through the step loop, they made ptxas spill there at head dim 128)."""
${setup}
    BLOCK_M: gl.constexpr = 16
    BLOCK_N: gl.constexpr = 64
    # 16 x 64, a thread's 8 weights a group of dropout's numbers: rows r and r + 8 by keys c + {0, 1, 8, 9}
    PART: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [0, 8], [0, 1]], lane_bases=[[0, 2], [0, 4], [0, 16], [0, 32], [1, 0]],
        warp_bases=[[2, 0], [4, 0]], block_bases=[], shape=[16, 64])
    for part in gl.static_range(64 // BLOCK_M):
        q_idx = start_m + part * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, PART))
        k_idx = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, PART))
${keep}
        drop_tile.slice(part * BLOCK_M, BLOCK_M).store(drop_keep.to(drop_tile.dtype))
''')


def function(kernel: LoweredProgram, name: str) -> str:
    """The instance's ``<name>_drop``, which regenerates a step's mask into shared memory."""
    text = "\n".join(" " * 8 + line for line in keep(layout="PART").splitlines())
    setup = "\n".join(" " * 4 + line for line in dropout_setup(kernel).splitlines())
    return _FUNCTION.substitute(name=name, state=DROPOUT_STATE, p=DROPOUT_P, setup=setup, keep=text)


def tile(first: int) -> str:
    """The consumer's line naming its tile: ``pds_smem``'s tiles ``first`` (the first warpgroup's) and the next."""
    return f"drop_tile = pds_smem.index({first} + HALF_ID)  # this warpgroup's dropout mask of a step (dkdv_dropout)"


def store(name: str) -> str:
    """A consumer's step lines that regenerate the step's mask (rows start_m.., this warpgroup's keys)."""
    return (
        f"{name}_drop(drop_tile, start_m, {STEP_SCALARS}, HQ, b, h, {DROPOUT_STATE}, {DROPOUT_P})"
        "\ngl.thread_barrier()  # the tile's mask, stored by other threads, before the chain reads it"
    )
