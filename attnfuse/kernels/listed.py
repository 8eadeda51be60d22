"""The forward template's code for a program whose mask lists its blocks (``BlockList``: block sparsity), written
into the instance only for such a program (``kernels/forward.py``).

The program's 2 x 64 query rows lie in one of the list's query blocks (``capability.block_list_reason``: its
block size is a multiple of 128), ``list_block``. Step j visits tile j % list_tiles (BLOCK_N keys) of the
(j // list_tiles)-th key block the mask lists for it, as the generated kernels' flat loop does
(``passes/codegen/loops.py: visit``): the loader warp reads the list to bring the block's keys through TMA, the
consumers read it to know each step's keys and whether the block is partial. A listed block runs the other
masks where their facts do not keep the tile whole, and the listing mask's own keep only where the list calls
the block partial. Rows whose list is empty visit nothing: the careful redo, following the same (empty) list,
writes their out and lse. A float8 instance's loader reads V's transposed copy at the keys' columns
(``fp8_columns.load_key_block_fp8``).
"""

from __future__ import annotations

import re
import string

import attrs

from ..passes.codegen.fp8 import is_fp8
from ..passes.codegen.loops import listing_mask
from ..passes.lower import Instance, LoweredProgram
from ..passes.codegen.text import indent
from .gluon_text import for_template

IMPORT = "from attnfuse.kernels.listed_pipeline import load_key_block, load_query_tiles\n"
KEYS = "the n_steps tiles of the key blocks listed for them (step j: tile j % list_tiles of the j // list_tiles-th)"
CAREFUL_KEYS = "the key blocks listed for them"

_LOADER = string.Template('''
@gluon.jit
def ${name}_loader(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, b, h, hk, m0, n_steps, ${list_args}
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: the two Q tiles of rows m0.., then step j's keys into stage j % STAGES: tile j % list_tiles of
    the (j // list_tiles)-th key block ${prefix} lists for the rows."""
    q_ready, k_ready, v_ready, kv_free = bars
    load_query_tiles(q_desc, q_smem, q_ready, b, h, m0)
$lists
    for j in range(n_steps):
$key
        ${load}
''')


def without_listing(kernel: LoweredProgram) -> LoweredProgram:
    """``kernel`` without its listing mask (``kernel`` itself if it has none): the other masks' facts bound a
    listed block's tiles and tell which of them they keep whole (the listing mask's own keep applies where its
    lists call a block partial)."""
    listing = listing_mask(kernel)
    return kernel if listing is None else attrs.evolve(kernel, masks=tuple(m for m in kernel.masks if m is not listing))


def lists(m: Instance, rows: str) -> str:
    """``list_size``, ``list_tiles`` (BLOCK_N tiles a listed block) and ``list_block`` (the list of the query
    block holding row ``rows``)."""
    return (
        f"list_size = {m.code(m.fragment.block_list.size)}  # {m.prefix}: its lists' block size\n"
        "list_tiles = list_size // BLOCK_N\n"
        f"list_block = {rows} // list_size"
    )


def step_keys(m: Instance, step: str) -> str:
    """``start_n`` (and ``list_partial``, where the lists mark partial blocks) of step ``step``."""
    bl = m.fragment.block_list
    entry = f"({step}) // list_tiles"
    lines = [f"start_n = {m.code(bl.index, block='list_block', i=entry)} * list_size + ({step}) % list_tiles * BLOCK_N"]
    if bl.partial is not None:
        lines.append(f"list_partial = {m.code(bl.partial, block='list_block', i=entry)}")
    return "\n".join(lines)


def partial_keep(m: Instance) -> str | None:
    """The listing mask's keep where its lists mark partial blocks (it applies in those only), else None."""
    if m.fragment.keep and m.fragment.block_list.partial is not None:
        return for_template(m.fragment.keep)
    return None


def steps(m: Instance, name: str, plugin_args: str) -> str:
    """The kernel's ``n_steps``: the tiles of the blocks listed for its rows; none listed, the careful redo
    writes both halves' rows (their out and lse as the normaliser's init leaves them) and the program ends."""
    bl = m.fragment.block_list
    count = m.code(bl.count, block="m0 // list_size")
    careful = (
        f"{name}_careful(\n    Q, K, V, Out, q_desc, k_desc, v_desc, o_desc, Lse, pid_bh, {{first}}, start, 0, Nq, N_K,"
        f" HQ, GROUP,\n    sm_scale, qk_scale, {plugin_args}SAVE_LSE,\n)"
    )
    return indent(
        f"list_size = {m.code(bl.size)}  # {m.prefix}: its lists' block size\n"
        f"n_steps = {count} * (list_size // BLOCK_N)\n"
        f"if n_steps == 0:  # {m.prefix} lists no key block for these rows\n"
        + indent(careful.format(first="m0"), 4)
        + "\n"
        + indent(careful.format(first="m0 + ROWS"), 4)
        + "\n    return",
        4,
    )


def first_key(m: Instance) -> str:
    """The consumer's lists and block 0's keys."""
    return indent(lists(m, "m0") + "\n" + step_keys(m, "0"), 4)


def step_key(m: Instance) -> str:
    """The consumer's keys of step j."""
    return indent(step_keys(m, "j"), 8)


def careful_loop(m: Instance) -> str:
    """The careful redo's loop header over the listed blocks, BLOCK_N (16) keys at a time."""
    bl = m.fragment.block_list
    count = m.code(bl.count, block="list_block")
    return (
        indent(lists(m, "first"), 4)
        + f"\n    for list_t in range(0, {count} * list_tiles):\n"
        + indent(step_keys(m, "list_t"), 8)
    )


def _reads(m: Instance, kernel: LoweredProgram) -> list[str]:
    """The plugin arguments that the list's block size and its index read, in the kernel's order."""
    bl = m.fragment.block_list
    code = f"{m.code(bl.size)}\n{m.code(bl.index, block='list_block', i='j')}"
    return [a.name for a in kernel.args() if re.search(rf"\b{re.escape(a.name)}\b", code)]


def loader(m: Instance, kernel: LoweredProgram, name: str) -> str:
    """The instance's loader warp (``pipeline.forward_loader``'s protocol, through ``listed_pipeline``)."""
    args = "".join(f"{a}, " for a in _reads(m, kernel))
    return _LOADER.substitute(
        name=name,
        prefix=m.prefix,
        list_args=args,
        lists=indent(lists(m, "m0"), 4),
        key=indent(step_keys(m, "j").splitlines()[0], 8),
        load=(
            "load_key_block_fp8(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, b, hk, start_n, start_n, j, "
            "STAGES)"  # float8: V's transposed copy, start_n its column
            if is_fp8(kernel)
            else "load_key_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, b, hk, start_n, j, STAGES)"
        ),
    )


def loader_call(m: Instance, kernel: LoweredProgram, name: str) -> str:
    """The loader's entry in the kernel's ``warp_specialize``."""
    args = "".join(f"{a}, " for a in _reads(m, kernel))
    return (
        f"                {name}_loader,\n"
        f"                (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, b, h, hk, m0, n_steps, {args}"
        "BLOCK_N, STAGES),"
    )
