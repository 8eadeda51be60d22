"""The forward template's text for a call's facts: per-sequence key counts (``KernelConfig.kv_lens``), given
positions (``positions``: Q_OFFSET, K_OFFSET, N_SEQ) and packed sequences (``varlen``: cu_seqlens), each as the
generated forward has it (``passes/codegen/operands.py``, ``loops.py``, ``packed.py``). A program with none of
them gets the text of a plain call, so its instance's source is unchanged.

Packed sequences: a program is a (query block of a document, query head), its document found from its place in
the grid as the generated kernel finds it (``packed.document``: offsets clamped to the packed lengths, no host
sync); from there its lengths are the document's and its indices local to it. The loader's TMA coordinates are
packed rows (``q_start`` and ``k_start`` added); rows and keys it reads past the document's end belong to the
next one and are masked (``q_ok``, ``k_ok`` from the document's lengths: the block holding its last key is
always a masked one). Out is stored through TMA only where a consumer's 64 rows are all the document's, else
through a pointer store of its rows alone; lse by pointer, at the document's rows. A float8 call reads V from its
transposed copy, where each document starts on a column of its own, ``v_start``
(``launch_fp8_packed.document_values``).
"""

from __future__ import annotations

from attrs import frozen

from ..launch_spec import Param
from ..passes.codegen import packed
from ..passes.codegen.common import kv_params
from ..passes.codegen.dropout import dropout_params
from ..passes.codegen.fp8 import is_fp8
from ..passes.codegen.operands import key_count, key_shift, kv_length, position, query_shift
from ..passes.lower import LoweredProgram

_STORE_TILE = """\
q.store(out.to(dtype))  # the Q tile is read: stage out there
fence_async_shared()
tma.async_copy_shared_to_global(o_desc, [b, h, {first}, 0], q_smem.index(HALF_ID))
tma.store_wait(0)"""

_STORE_DOCUMENT = """\
if m0 + HALF_ID * BLOCK_M + BLOCK_M <= Nq:  # every row is the document's
{tile}
else:  # the next document's rows follow this one's: store this one's alone
    o_rows = gl.convert_layout(q_idx, O_ROWS)
    d_out = gl.expand_dims(gl.arange(0, DV, layout=gl.SliceLayout(0, O_LAYOUT)), 0)
    gl.store(
        Out + row_offsets(o_desc, b, h, gl.expand_dims(q_start + o_rows, 1), d_out),
        out.to(dtype),
        mask=gl.expand_dims(o_rows < Nq, 1),
    )"""


# a float8 packed call's document's first column in V's transposed copy (``launch_fp8_packed.document_values``)
_VALUE_START = f"v_start = {packed.padded_start('k_start', 'KEY_CHUNK')}  # float8: the document's first column of V\n"


@frozen
class ForwardFacts:
    """The pieces of a forward instance's text that a call's facts change (see ``forward_facts``)."""

    entry_params: str  # the entry's parameters for the facts, each followed by ", "
    passed: str  # what the entry passes on to the consumers and the careful redo, and they take: likewise
    program: str  # entry code: the program's m0, b, h, hk, Nk, q_lo, q_hi (returns past a document's end)
    key_length: str  # a consumer's Nk
    query_shift: str  # query index -> position
    aligned: str  # what that shift says, in words
    key_position: str  # k_pos of the keys k_idx
    key_count: str  # the keys a program's k holds: k_idx below it exist
    query_rows: str  # load_rows' (first, bound) of q's rows first.. in the careful redo
    key_rows: str  # and of k's rows start_n..
    value_rows: str  # and of v's (a float8 call's: of its transposed copy's columns)
    out_rows: str  # the rows of out (and of q) of the queries q_idx
    loader_rows: str  # the loader's first q row and first key row of the program (a packed float8 call's: and V's
    # copy's first column)
    store_out: str  # a consumer's store of its out tile
    grid: str  # the launch's grid, in words


def fact_params(kernel: LoweredProgram) -> tuple[Param, ...]:
    """The parameters of ``kernel``'s facts: the generated kernels' ``kv_params`` but attention dropout's, which the
    template takes after the plugins' arguments (``forward.forward_params``)."""
    dropout = {p.name for p in dropout_params(kernel)}
    return tuple(p for p in kv_params(kernel) if p.name not in dropout)


def packed_program() -> str:
    """Entry code of a packed call's query-block program (forward, dQ): from its place in the grid, the longest
    causal rows first, its document (``packed.document``: q_start, k_start, TOTAL_Q, Nq and N_K the document's;
    returns past its end) and its first row in it, m0."""
    return (
        "pid_m = gl.num_programs(1) - 1 - gl.program_id(1)  # the longest causal rows first\n"
        + packed.document("pid_m", "BLOCK_M", "q", (), ())
        + "m0 = pid_m * BLOCK_M\n"
    )


def forward_facts(kernel: LoweredProgram) -> ForwardFacts:
    """The text of ``kernel``'s facts for the forward template."""
    c = kernel.config
    entry = [p.name for p in fact_params(kernel)]
    passed = [n for n in entry if n not in ("CuQ", "CuK", "DOCS", "SEARCH_STEPS")]
    shift = query_shift(kernel)
    fp8 = is_fp8(kernel)
    if c.varlen:
        passed = ["q_start", "k_start", *(["v_start"] if fp8 else []), "TOTAL_Q", *passed]
        program = packed_program() + (_VALUE_START if fp8 else "")
    else:
        program = "m0 = (gl.num_programs(1) - 1 - gl.program_id(1)) * BLOCK_M\n"
    program += (
        "b = pid_bh // HQ\nh = pid_bh % HQ\nhk = h // GROUP\n"
        + kv_length(kernel)
        + f"q_lo = m0 + {shift}\nq_hi = tl.minimum(m0 + BLOCK_M, Nq) - 1 + {shift}\n"
    )
    q0, k0 = ("q_start + ", "k_start + ") if c.varlen else ("", "")
    v0 = "v_start + " if c.varlen and fp8 else k0
    tile = _STORE_TILE.format(first=f"{q0}m0 + HALF_ID * BLOCK_M")
    indented = "".join(f"    {line}\n" for line in tile.splitlines()).rstrip("\n")
    return ForwardFacts(
        entry_params="".join(f"{n}, " for n in entry),
        passed="".join(f"{n}, " for n in passed),
        program=program,
        key_length=kv_length(kernel).strip(),
        query_shift=shift,
        aligned=(
            "the call's positions: query i at Q_OFFSET + i"
            if c.positions
            else "bottom-right aligned: the last query sees the last key"
        ),
        key_position=position(kernel, f"k_idx + {key_shift(kernel)}") if c.positions else "k_idx",
        key_count=key_count(kernel),
        query_rows=f"{q0}first, {q0}Nq",
        key_rows=f"{k0}start_n, {k0}{key_count(kernel)}",
        value_rows=f"{v0}start_n, {v0}{key_count(kernel)}",
        out_rows=f"{q0}q_idx",
        loader_rows=f"{q0}m0, {k0}start" + (f", {v0}start" if c.varlen and fp8 else ""),
        store_out=_STORE_DOCUMENT.format(tile=indented) if c.varlen else tile,
        grid="(HQ, Nq // 128 + DOCS), Nq the packed total" if c.varlen else "(B * HQ, cdiv(Nq, 128))",
    )
