"""The dQ template's code for a program whose mask lists its blocks (``BlockList``: block sparsity), written into
the instance only for such a program (``kernels/dq.py``).

As the forward template's (``kernels/listed.py``, whose list reading it shares): the program's 2 x 64 query rows
lie in one of the lists' query blocks (``capability.block_list_reason``: its block size is a multiple of 128),
``list_block``, and step j visits tile j % list_tiles (BLOCK_N keys) of the (j // list_tiles)-th key block the
mask lists for it: the loader warp reads the list to bring the block's keys through TMA, the consumers read it
to know each step's keys and whether the block is partial. A listed block runs the other masks where their facts
do not keep the tile whole, and the listing mask's own keep only where the list calls the block partial. Rows
whose list is empty visit nothing: their dQ is 0 (and their delta is written, for the dK/dV kernel).
"""

from __future__ import annotations

import re
import string

from ..passes.codegen.text import indent
from ..passes.lower import Instance, LoweredProgram
from .gluon_text import for_template
from .listed import lists, step_keys

IMPORT = (
    "from attnfuse.kernels.listed_backward_pipeline import load_query_rows\n"
    "from attnfuse.kernels.listed_pipeline import load_key_block\n"
)

_LOADER = string.Template('''
@gluon.jit
def ${name}_loader(
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, bars, b, h, hk, m0, n_steps, ${list_args}
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: the two Q and dO tiles of rows m0.., then step j's keys into stage j % STAGES: tile j % list_tiles
    of the (j // list_tiles)-th key block ${prefix} lists for the rows."""
    q_ready, k_ready, v_ready, kv_free = bars
    load_query_rows(q_desc, do_desc, q_smem, do_smem, q_ready, b, h, m0)
$lists
    for j in range(n_steps):
$key
        load_key_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, b, hk, start_n, j, STAGES)
''')

_CALL = string.Template("""\
            (
                ${name}_loader,
                (
                    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, bars, b, h, hk, m0, n_steps,
                    ${list_args}BLOCK_N, STAGES,
                ),
            ),""")


def n_steps(m: Instance) -> str:
    """The kernel's ``n_steps`` (its line and the next, indented for the kernel's body): the tiles of the key
    blocks listed for its rows; none listed, the rows' dQ is 0."""
    bl = m.fragment.block_list
    return (
        f"list_size = {m.code(bl.size)}  # {m.prefix}: its lists' block size\n"
        f"    n_steps = {m.code(bl.count, block='m0 // list_size')} * (list_size // BLOCK_N)  # none: dQ 0"
    )


def loop(m: Instance) -> str:
    """The consumer's key loop header: the lists of its rows' query block, then step j's keys (``start_n``), its
    block's ``list_partial`` flag, and whether the other masks' facts mask it."""
    return "\n".join(
        [
            lists(m, "m0"),
            "for j in range(n_steps):",
            "    stage = j % STAGES",
            "    phase = (j // STAGES) & 1",
            indent(step_keys(m, "j"), 4).rstrip("\n"),
            "    masked = (start_n < full_start) | (start_n >= full_end)",
        ]
    )


def partial_keep(m: Instance) -> list[str]:
    """The chain's lines that apply the listing mask's keep where its list calls the step's block partial (none
    where its lists mark no block partial: every listed block is kept whole)."""
    if not m.fragment.keep or m.fragment.block_list.partial is None:
        return []
    return [
        f"if list_partial:  # {m.prefix}: a partial listed block, masked element by element",
        f"    ds = tl.where({for_template(m.fragment.keep)}, ds, 0.0)",
    ]


def _reads(m: Instance, kernel: LoweredProgram) -> str:
    """The plugin arguments that the lists' block size and index read, in the kernel's order (each followed by a
    comma)."""
    code = f"{lists(m, 'm0')}\n{step_keys(m, 'j')}"
    return "".join(f"{a.name}, " for a in kernel.args() if re.search(rf"\b{re.escape(a.name)}\b", code))


def loader(m: Instance, kernel: LoweredProgram, name: str) -> str:
    """The instance's loader warp (``dq_pipeline.dq_loader``'s protocol, through ``listed_backward_pipeline``)."""
    return _LOADER.substitute(
        name=name,
        prefix=m.prefix,
        list_args=_reads(m, kernel),
        lists=indent(lists(m, "m0"), 4).rstrip("\n"),
        key=indent(step_keys(m, "j").splitlines()[0], 8).rstrip("\n"),
    )


def loader_call(m: Instance, kernel: LoweredProgram, name: str) -> str:
    """The loader's entry in the kernel's ``warp_specialize``."""
    return _CALL.substitute(name=name, list_args=_reads(m, kernel))
