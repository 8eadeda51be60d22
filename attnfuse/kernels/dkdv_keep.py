"""A masked dK/dV step's keep, stored in shared memory before the step's products (``kernels/dkdv.py``).

Evaluated in the chain on the whole (64 x 64) tile, beside the step's scores, dK and dV, a mask's keep (its
positions, its loads' addresses) made ptxas spill the step loop of every masked instance at head dim 128 and of
every program following block lists. So such an instance evaluates a masked step's keep first, while only dK and
dV are live, 8 rows at a time (a thread holds 4 of the pairs, not 32), into a 64 x 64 tile of shared memory per
consumer warpgroup (after its P and dS tiles in ``pds_smem``); the chain reads it there (``CHAIN_KEEP``). Its
key vectors are computed in each step, not held across the loop (ALiBi's made ptxas spill there). With
attention dropout at any head dim (its mask takes the same road: ``dkdv_dropout``).
"""

from __future__ import annotations

import re
import string

from ..passes.codegen.loops import listing_mask
from ..passes.codegen.scores import has_masks
from ..passes.lower import LoweredProgram
from .gluon_text import for_template

HEAD_DIMS = (128,)  # where a program with masks stores them; at head dim 64 (no dropout) its loop does not spill
TILE = "keep_tile = pds_smem.index(4 + HALF_ID)  # this warpgroup's keep of a masked step (dkdv_keep)"
CHAIN_KEEP = "keep = keep_tile.load(S_LAYOUT) != 0  # as the step stored it (dkdv_keep)"
# the step's scalars a consumer passes the functions that evaluate it a part at a time (its keys' first, Nq, Nk),
# each through ``dkdv_pipeline.opaque``: their positions are computed in the step, not held across the loop
STEP_SCALARS = "opaque(n0 + HALF_ID * BLOCK_N), opaque(Nq), opaque(Nk)"
# a packed call's first rows of its document, which a fragment reading its tensors at packed rows reads
# (``passes/lower.py: packed_rows``)
DOCUMENT_ROWS = ("q_start", "k_start")


# The functions that evaluate fragments a part of a step's rows at a time (here, and ``dkdv_mods``): a part's tile
# as the fragments see it (``gluon_text.for_template``'s names), and the positions of part ``part`` of rows
# start_m.. and keys k0..
def part_layouts(rows: int, layout: str, what: str) -> str:
    """The constants of a part of ``rows`` rows and 64 keys laid out as ``layout`` (``what``: how, a comment)."""
    return f"""\
    BLOCK_M: gl.constexpr = {rows}
    BLOCK_N: gl.constexpr = 64
    S_LAYOUT: gl.constexpr = {layout}  # {what}
    ROW_LAYOUT: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    KEY_LAYOUT: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)"""


LAYOUTS = part_layouts(8, "gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])", "8 x 64: 4 pairs a thread")
POSITIONS = """\
        q_idx = start_m + part * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW_LAYOUT)
        k_idx = k0 + gl.arange(0, BLOCK_N, layout=KEY_LAYOUT)
        q_pos = q_idx + (Nk - Nq)  # bottom-right aligned, as the consumer's
        k_pos = k_idx
        q_ok = q_idx < Nq
        k_ok = k_idx < Nk
        in_bounds = q_ok[:, None] & k_ok[None, :]"""

_FUNCTION = string.Template('''
@gluon.jit
def ${name}_keep(keep_tile, start_m, k0, Nq, Nk, HQ, GROUP, b, h${args}):
    """A masked step's keep of its (64 x 64) tile, rows start_m.. and keys k0.., into keep_tile (0 or 1 in its
    dtype): ${what}, 8 rows at a time. Rows of shared memory are sliced by 8, the swizzle's unit. The fragments'
    tile is the part (``BLOCK_M``, ``S_LAYOUT``: what ``gluon_text.for_template`` gives their constructors)."""
${layouts}
    for part in gl.static_range(64 // BLOCK_M):
${positions}
        keep_tile.slice(part * BLOCK_M, BLOCK_M).store(($keep).to(keep_tile.dtype))
''')


def stores_keep(kernel: LoweredProgram) -> bool:
    """Whether ``kernel``'s dK/dV instance stores a masked step's keep: a program following block lists, or one
    with masks at a head dim of ``HEAD_DIMS`` or with attention dropout."""
    if listing_mask(kernel) is not None:
        return True
    return has_masks(kernel) and (kernel.config.head_dim in HEAD_DIMS or kernel.config.dropout)


def keep_text(kernel: LoweredProgram) -> str:
    """A masked step's keep: rows below Nq, every mask's own, and a listing mask's only where its lists call the
    block partial (``list_partial``; none: every listed block is kept whole). Not keys below Nk: a key past Nk
    (TMA's zero rows) reaches only its own rows of dK and dV, which are never stored."""
    listing = listing_mask(kernel)
    keeps = ["q_ok[:, None]"]
    keeps += [f"({for_template(m.fragment.keep)})" for m in kernel.masks if m.fragment.keep and m is not listing]
    if listing is not None and listing.fragment.keep and listing.fragment.block_list.q_partial is not None:
        keeps.append(f"(({for_template(listing.fragment.keep)}) | (list_partial == 0))")
    return " & ".join(keeps)


def reads(kernel: LoweredProgram, code: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The plugin arguments that ``code`` reads, in the kernel's order, then the document's first rows
    (``DOCUMENT_ROWS``) and those of ``extra`` it reads."""
    names = [a.name for a in kernel.args()] + list(DOCUMENT_ROWS) + list(extra)
    return [n for n in names if re.search(rf"\b{re.escape(n)}\b", code)]


def _arguments(kernel: LoweredProgram) -> str:
    return "".join(f", {a}" for a in reads(kernel, keep_text(kernel), ("list_partial",)))


def function(kernel: LoweredProgram, name: str) -> str:
    """The instance's ``<name>_keep``, which stores a masked step's keep."""
    what = "rows below Nq, the masks' own"
    if "list_partial" in keep_text(kernel):
        what += f" ({listing_mask(kernel).prefix}'s where its lists call the block partial, ``list_partial``)"
    return _FUNCTION.substitute(
        name=name, args=_arguments(kernel), what=what, layouts=LAYOUTS, positions=POSITIONS, keep=keep_text(kernel)
    )


def store(kernel: LoweredProgram, name: str) -> str:
    """A consumer's step lines that store a masked step's keep (step rows start_m.., this warpgroup's keys)."""
    return (
        f"if masked:\n    {name}_keep(keep_tile, start_m, {STEP_SCALARS}, HQ, GROUP, b, h"
        f"{_arguments(kernel)})\n    gl.thread_barrier()  # the tile's keep, stored by other threads, before the "
        "chain reads it"
    )
