"""The dK/dV template's code for a program whose mask lists its blocks (``BlockList``: block sparsity), written
into the instance only for such a program (``kernels/dkdv.py``).

The program's 2 x 64 keys lie in one of the lists' key blocks (``capability.block_list_reason``: its block size
is a multiple of 128), ``list_block``. For each of the program's query heads in turn, step j visits query tile
j % list_tiles (64 rows) of the (j // list_tiles)-th query block the mask lists for that key block (its column
list, ``BlockList.q_count`` and ``q_index``, as the generated dK/dV kernel follows it): the loader warp reads the
list to bring the tile's Q and dO (and rows) through TMA, the consumers read it to know each step's rows and
whether the block is partial (``q_partial``). A listed block runs the other masks where their facts do not keep
the tile whole, and the listing mask's own keep only where the lists call the block partial. Keys that no query
block lists get dK = dV = 0.
"""

from __future__ import annotations

import re
import string

from ..passes.codegen.loops import listing_mask
from ..passes.lower import Instance, LoweredProgram
from .gluon_text import for_template

IMPORT = "from attnfuse.kernels.listed_backward_pipeline import load_key_tiles, load_query_tile\n"

_LOADER = string.Template('''
@gluon.jit
def ${name}_loader(
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
    bars, b, h0, hkv, n0, heads, row_stride, HQ, ${list_args}BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: both halves' K and V tiles, then for each query head h0.. in turn, step t's Q and dO tiles (with
    their rows' lse and delta where the normaliser reads them) into stage t % STAGES: query tile j % list_tiles of
    the (j // list_tiles)-th query block ${prefix} lists for the keys."""
    load_key_tiles(k_desc, v_desc, k_smem, v_smem, bars, b, hkv, n0)
$walk
        load_query_tile(
            q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, bars, b, h, start_m, t,
            row_stride, HQ, STAGES, ${has_lse}, ${has_delta},
        )
''')

_KEEP = string.Template('''
@gluon.jit
def ${name}_keep(keep_tile, list_partial, start_m, k0, Nq, Nk, HQ, GROUP, b, h${args}):
    """A masked step's keep of its (64 x 64) tile, rows start_m.. and keys k0.., into keep_tile (0 or 1 in its
    dtype): rows below Nq, the masks' own (${prefix}'s where its lists call the block partial, ``list_partial``),
    8 rows at a time, so that a thread holds 4 of the pairs, not 32 (evaluated on the whole tile in the chain,
    beside the step's scores and dK and dV, its loads' addresses made ptxas spill the step loop; 16 rows at a time,
    a quarter as much). Rows of shared memory are sliced by 8, the swizzle's unit."""
    PART: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])  # 8 x 64: 4 pairs a thread
    for part in gl.static_range(8):
        q_idx = start_m + part * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, PART))
        k_idx = k0 + gl.arange(0, 64, layout=gl.SliceLayout(0, PART))
        q_pos = q_idx + (Nk - Nq)  # bottom-right aligned, as the consumer's
        k_pos = k_idx
        q_ok = q_idx < Nq
        k_ok = k_idx < Nk
        in_bounds = q_ok[:, None] & k_ok[None, :]
        keep_tile.slice(part * 8, 8).store(($keep).to(keep_tile.dtype))
''')

_CALL = string.Template("""\
            (
                ${name}_loader,
                (
                    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                    lse_smem, delta_smem, bars, b, h0, hkv, n0, heads, row_stride, HQ, ${list_args}BLOCK_M, STAGES,
                ),
            ),""")


def _indent(code: str, spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line if line.strip() else "" for line in code.splitlines())


CHAIN_KEEP = "keep = keep_tile.load(S_LAYOUT) != 0  # as the step stored it (dkdv_listed.steps)"


def _keep(kernel: LoweredProgram) -> str:
    """The keep ``_KEEP`` stores: rows below Nq, the other masks' keeps, and the listing mask's where its lists
    call the block partial (none: every listed block is kept whole)."""
    listing = listing_mask(kernel)
    keeps = ["q_ok[:, None]"]
    keeps += [f"({for_template(m.fragment.keep)})" for m in kernel.masks if m.fragment.keep and m is not listing]
    if listing.fragment.keep and listing.fragment.block_list.q_partial is not None:
        keeps.append(f"(({for_template(listing.fragment.keep)}) | (list_partial == 0))")
    return " & ".join(keeps)


def _count(m: Instance) -> str:
    """The steps of query head ``h``: the query tiles of the blocks its list names for the key block."""
    return f"{m.code(m.fragment.block_list.q_count, block='list_block')} * list_tiles"


def walk(m: Instance) -> str:
    """The steps' loop, and step t's query head ``h`` and first row ``start_m``, as both the loader and the
    consumers walk them: ``list_size``, ``list_tiles`` (query tiles of BLOCK_M rows a listed block) and
    ``list_block`` (the key block holding the program's keys), then every query head's steps in turn, in one flat
    loop (nested loops over heads and lists made ptxas spill the consumers' step loop)."""
    entry = m.code(m.fragment.block_list.q_index, block="list_block", i="j // list_tiles")
    return f"""\
list_size = {m.code(m.fragment.block_list.size)}  # {m.prefix}: its lists' block size
list_tiles = list_size // BLOCK_M
list_block = n0 // list_size
n_steps = 0
for hh in range(heads):
    h = h0 + hh
    n_steps += {_count(m)}
h = h0
t_head = 0  # the first step of head h
n_head = {_count(m)}
for t in range(n_steps):
    while t - t_head >= n_head:  # head h's steps are done (a head whose list is empty has none): the next head's
        t_head += n_head
        h += 1
        n_head = {_count(m)}
    j = t - t_head
    start_m = {entry} * list_size + j % list_tiles * BLOCK_M"""


def steps(m: Instance, kernel: LoweredProgram, name: str, rows: str, step: str) -> str:
    """The consumer's steps over the query tiles listed for its keys, head by head: each step's ``rows`` (its
    q_idx, q_pos, q_ok), then ``step`` (from its products to freeing its stage). A masked step (where the other
    masks' facts say, or in a block the lists call partial) first stores its keep in shared memory (``_KEEP``),
    while only dK and dV are live, and its chain reads it there (``CHAIN_KEEP``)."""
    bl = m.fragment.block_list
    masked = "masked = (start_m < full_start) | (start_m >= full_end)"
    body = ["stage = t % STAGES", "phase = (t // STAGES) & 1"]
    partial = "0"
    if bl.q_partial is not None:
        body.append(f"list_partial = {m.code(bl.q_partial, block='list_block', i='j // list_tiles')}")
        masked += f" | list_partial  # {m.prefix}: a partial listed block, masked element by element"
        partial = "list_partial"
    args = "".join(f", {a}" for a in reads(m, kernel, _keep(kernel)))
    body += [
        masked,
        rows,
        "if masked:",
        f"    {name}_keep(keep_tile, {partial}, start_m, n0 + HALF_ID * BLOCK_N, Nq, Nk, HQ, GROUP, b, h{args})",
        "    gl.thread_barrier()  # the tile's keep, stored by other threads, before the chain reads it",
        step,
    ]
    head = f"keep_tile = pds_smem.index(4 + HALF_ID)  # this warpgroup's keep of a masked step\n{walk(m)}"
    return head + "\n" + _indent("\n".join(body), 4)


def reads(m: Instance, kernel: LoweredProgram, code: str) -> list[str]:
    """The plugin arguments that ``code`` reads, in the kernel's order."""
    return [a.name for a in kernel.args() if re.search(rf"\b{re.escape(a.name)}\b", code)]


def functions(m: Instance, kernel: LoweredProgram, name: str, has_lse: bool, has_delta: bool) -> str:
    """The consumers' evaluation of a masked step's keep (``_KEEP``), and the instance's loader warp
    (``dkdv_pipeline.dkdv_loader``'s protocol, through ``listed_backward_pipeline``)."""
    text = _keep(kernel)
    args = "".join(f", {a}" for a in reads(m, kernel, text))
    keep = _KEEP.substitute(name=name, prefix=m.prefix, args=args, keep=text)
    return keep + _LOADER.substitute(
        name=name,
        prefix=m.prefix,
        list_args="".join(f"{a}, " for a in reads(m, kernel, walk(m))),
        walk=_indent(walk(m), 4),
        has_lse=has_lse,
        has_delta=has_delta,
    )


def loader_call(m: Instance, kernel: LoweredProgram, name: str) -> str:
    """The loader's entry in the kernel's ``warp_specialize``."""
    return _CALL.substitute(name=name, list_args="".join(f"{a}, " for a in reads(m, kernel, walk(m))))
