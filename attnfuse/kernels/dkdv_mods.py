"""A dK/dV step's score modifications staged through shared memory (``kernels/dkdv.py``).

A modification that reads a tensor per score (an additive bias), applied on the whole (64 x 64) tile, holds a
load address for each of a thread's 32 scores beside the step's S, dK and dV: at head dim 128 ptxas spilled a few
hundred bytes in the step loop; one that reads the scores' positions (ALiBi) holds a thread's position offsets
there, and ptxas spilled 32 to 40 bytes around it. Such an instance stores the step's scaled scores (float32) in a
64 x 64 tile of shared memory per consumer warpgroup, applies the modifications to it 2 rows at a time, and reads
it back. A part of 2 x 64 scores lies across the warpgroup's 128 threads twice over (``_LAYOUTS``: a thread holds
2 scores of one key, the two halves of the warpgroup the same ones): of the part shapes compiled (1 to 8 scores a
thread, 2 to 64 rows), the only one whose step loop spills nothing at head dim 128 (8 rows a part, 4 scores a
thread: 44 bytes).
Only where every modification's gradient is the identity (its input is not kept for the chain) and there is no
attention dropout (``stages_mods``). A packed call's modification reads the tensor at packed rows, its addresses
offset by the document's first rows: such an instance stages them at head dim 64 too.
"""

from __future__ import annotations

import re
import string

from ..passes.lower import LoweredProgram
from ..passes.codegen.text import indent
from . import dkdv_keep
from .gluon_text import for_template

HEAD_DIMS = (128,)  # where such a program stages them; at head dim 64 its step loop does not spill
PACKED_HEAD_DIMS = (64, 128)  # and a packed call's (unstaged at head dim 64, its step loop spilled 44 bytes)
_POSITIONS = re.compile(r"\b[qk]_(?:pos|idx)\b")  # a modification that reads the scores' positions (ALiBi)
TILE = "s_tile = s_smem.index(HALF_ID)  # this warpgroup's scores, staged for the modifications (dkdv_mods)"
ALLOCATION = (
    "s_smem = gl.allocate_shared_memory(gl.float32, [2, ROWS, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))"
    "  # each consumer's scores (dkdv_mods)"
)

_LAYOUTS = dkdv_keep.part_layouts(2, "gl.BlockedLayout([2, 1], [1, 32], [1, 4], [1, 0])", "2 x 64, twice over")
_FUNCTION = string.Template('''
@gluon.jit
def ${name}_mods(s_tile, start_m, k0, Nq, Nk, HQ, GROUP, b, h${args}):
    """The score modifications of a step's (64 x 64) scores in s_tile (float32, scaled), rows start_m.. and keys
    k0.., in place, 2 rows at a time. The fragments' tile is the part (``BLOCK_M``, ``S_LAYOUT``)."""
${layouts}${prologues}
    for part in gl.static_range(64 // BLOCK_M):
${positions}
        s = s_tile.slice(part * BLOCK_M, BLOCK_M).load(S_LAYOUT)
${bodies}
        s_tile.slice(part * BLOCK_M, BLOCK_M).store(s)
''')


def stages_mods(kernel: LoweredProgram) -> bool:
    """Whether ``kernel``'s dK/dV instance stages its score modifications: every one's gradient is the identity,
    without attention dropout, and one reads a tensor per score at a head dim of ``HEAD_DIMS``
    (``PACKED_HEAD_DIMS`` in a packed call) or the scores' positions at a head dim of ``HEAD_DIMS``."""
    mods, head_dim = kernel.mods, kernel.config.head_dim
    loads = any("tl.load" in m.fragment.body for m in mods)
    positions = any(_POSITIONS.search(m.fragment.body) for m in mods)
    return (
        not any(m.fragment.grad for m in mods)
        and not kernel.config.dropout
        and (
            (loads and head_dim in (PACKED_HEAD_DIMS if kernel.config.varlen else HEAD_DIMS))
            or (positions and head_dim in HEAD_DIMS)
        )
    )


def _text(kernel: LoweredProgram) -> tuple[str, str]:
    """The modifications' prologues and bodies, in order."""
    prologues = [
        f"# {m.prefix}: prologue\n{for_template(m.fragment.prologue)}" for m in kernel.mods if m.fragment.prologue
    ]
    bodies = [f"# {m.prefix}: score modification\n{for_template(m.fragment.body)}" for m in kernel.mods]
    return "\n".join(prologues), "\n".join(bodies)


def _arguments(kernel: LoweredProgram) -> str:
    return "".join(f", {a}" for a in dkdv_keep.reads(kernel, "\n".join(_text(kernel))))


def function(kernel: LoweredProgram, name: str) -> str:
    """The instance's ``<name>_mods``."""
    prologues, bodies = _text(kernel)
    return _FUNCTION.substitute(
        name=name,
        args=_arguments(kernel),
        layouts=_LAYOUTS,
        prologues="\n" + indent(prologues, 4) if prologues else "",
        positions=dkdv_keep.POSITIONS,
        bodies=indent(bodies, 8),
    )


def apply(kernel: LoweredProgram, name: str) -> str:
    """A consumer's step lines that take its scaled scores ``s`` through the modifications, in shared memory."""
    return (
        "s_tile.store(s)\n"
        "gl.thread_barrier()  # every thread's scores in shared memory before the modifications read them\n"
        f"{name}_mods(s_tile, start_m, {dkdv_keep.STEP_SCALARS}, HQ, GROUP, b, h{_arguments(kernel)})\n"
        "gl.thread_barrier()  # the modified scores, stored by other threads, before they are read back\n"
        "s = s_tile.load(S_LAYOUT)"
    )
