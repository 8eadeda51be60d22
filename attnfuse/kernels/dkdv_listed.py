"""The dK/dV template's code for a program whose mask lists its blocks (``BlockList``: block sparsity), written
into the instance only for such a program (``kernels/dkdv.py``).

The program's 2 x 64 keys lie in one of the lists' key blocks (``capability.block_list_reason``: its block size
is a multiple of 128), ``list_block``. For each of the program's query heads in turn, step j visits query tile
j % list_tiles (64 rows) of the (j // list_tiles)-th query block the mask lists for that key block (its column
list, ``BlockList.q_count`` and ``q_index``, as the generated dK/dV kernel follows it): the loader warp reads the
list to bring the tile's Q and dO (and rows) through TMA, the consumers read it to know each step's rows and
whether the block is partial (``q_partial``). A listed block runs the other masks where their facts do not keep
the tile whole, and the listing mask's own keep only where the lists call the block partial (``dkdv_keep``
stores a masked step's keep). Keys that no query block lists get dK = dV = 0.
"""

from __future__ import annotations

import string

from ..passes.lower import Instance, LoweredProgram
from ..passes.codegen.text import indent
from . import dkdv_keep

IMPORT = "from attnfuse.kernels.listed_backward_pipeline import load_key_tiles, load_query_tile, read_step\n"
STEP_INFO = (  # the kernel's shared memory of each stage's step, which the loader writes and the consumers read
    "step_info = gl.allocate_shared_memory(gl.int32, [STAGES, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))"
    "  # each stage's step: query head, first row, partial block"
)

_LOADER = string.Template('''
@gluon.jit
def ${name}_loader(
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
    step_info, bars, b, h0, hkv, n0, heads, row_stride, HQ, ${list_args}BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: both halves' K and V tiles, then for each query head h0.. in turn, step t's Q and dO tiles (with
    their rows' lse and delta where the normaliser reads them) into stage t % STAGES: query tile j % list_tiles of
    the (j // list_tiles)-th query block ${prefix} lists for the keys."""
    load_key_tiles(k_desc, v_desc, k_smem, v_smem, bars, b, hkv, n0)
$walk
        ${partial}
        load_query_tile(
            q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, step_info, bars, b, h,
            start_m, partial, t, row_stride, HQ, STAGES, ${has_lse}, ${has_delta},
        )
''')

_CALL = string.Template("""\
            (
                ${name}_loader,
                (
                    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                    lse_smem, delta_smem, step_info, bars, b, h0, hkv, n0, heads, row_stride, HQ, ${list_args}BLOCK_M,
                    STAGES,
                ),
            ),""")


def _count(m: Instance) -> str:
    """The steps of query head ``h``: the query tiles of the blocks its list names for the key block."""
    return f"{m.code(m.fragment.block_list.q_count, block='list_block')} * list_tiles"


def count(m: Instance) -> str:
    """``list_size``, ``list_tiles`` (query tiles of BLOCK_M rows a listed block), ``list_block`` (the key block
    holding the program's keys) and ``n_steps``, the program's steps: the listed query tiles of all its heads."""
    return f"""\
list_size = {m.code(m.fragment.block_list.size)}  # {m.prefix}: its lists' block size
list_tiles = list_size // BLOCK_M
list_block = n0 // list_size
n_steps = 0
for hh in range(heads):
    h = h0 + hh
    n_steps += {_count(m)}"""


def walk(m: Instance) -> str:
    """The loader's loop over the steps (``count``), and step t's query head ``h`` and first row ``start_m``:
    every query head's steps in turn, in one flat loop (a ``while`` passes the heads whose list is empty)."""
    entry = m.code(m.fragment.block_list.q_index, block="list_block", i="j // list_tiles")
    return f"""\
{count(m)}
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


def _partial(m: Instance) -> str:
    """Step t's ``partial`` (1 where the lists call its block partial), as the loader hands it on."""
    bl = m.fragment.block_list
    if bl.q_partial is None:
        return "partial = 0  # no block is partial"
    return f"partial = ({m.code(bl.q_partial, block='list_block', i='j // list_tiles')}).to(tl.int32)"


def steps(m: Instance, kernel: LoweredProgram, name: str, rows: str, step: str) -> str:
    """The consumer's steps: as many as the loader's (``count``), each taking its query head, first row and
    partial flag from the loader (``listed_backward_pipeline.read_step``: following the lists here held their
    pointers through the step loop, and ptxas spilled), then its ``rows`` (q_idx, q_pos, q_ok) and ``step`` (from
    its products to freeing its stage). A masked step (where the other masks' facts say, or in a block the lists
    call partial) first stores its keep in shared memory (``dkdv_keep``)."""
    masked = "masked = (start_m < full_start) | (start_m >= full_end)"
    if m.fragment.block_list.q_partial is not None:
        masked += f" | list_partial  # {m.prefix}: a partial listed block, masked element by element"
    body = [
        "stage = t % STAGES",
        "phase = (t // STAGES) & 1",
        "mbarrier.wait(q_ready.index(stage), phase)  # the stage's tiles, and its step from the loader",
        "h, start_m, list_partial = read_step(step_info, stage)",
        masked,
        rows,
        dkdv_keep.store(kernel, name),
        step,
    ]
    return f"{dkdv_keep.TILE}\n{count(m)}\nfor t in range(n_steps):\n" + indent("\n".join(body), 4)


def _list_args(m: Instance, kernel: LoweredProgram) -> str:
    """The plugin arguments the loader's walk reads (its lists)."""
    return "".join(f"{a}, " for a in dkdv_keep.reads(kernel, f"{walk(m)}\n{_partial(m)}"))


def loader(m: Instance, kernel: LoweredProgram, name: str, has_lse: bool, has_delta: bool) -> str:
    """The instance's loader warp (``dkdv_pipeline.dkdv_loader``'s protocol, through
    ``listed_backward_pipeline``)."""
    return _LOADER.substitute(
        name=name,
        prefix=m.prefix,
        list_args=_list_args(m, kernel),
        walk=indent(walk(m), 4),
        partial=_partial(m),
        has_lse=has_lse,
        has_delta=has_delta,
    )


def loader_call(m: Instance, kernel: LoweredProgram, name: str) -> str:
    """The loader's entry in the kernel's ``warp_specialize``."""
    return _CALL.substitute(name=name, list_args=_list_args(m, kernel))
