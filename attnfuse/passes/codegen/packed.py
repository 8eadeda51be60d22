"""Packed sequences (``KernelConfig.varlen``): q and k hold documents one after another (B = 1), document i
at rows cu_q[i] .. cu_q[i + 1] of q and cu_k[i] .. cu_k[i + 1] of k, each attending within itself.

A kernel's grid covers ``TOTAL // BLOCK + DOCS`` blocks per head, with no host sync: document i takes the
blocks ``cu[i] // BLOCK + i`` .. ``cu[i + 1] // BLOCK + i`` (at least cdiv(len_i, BLOCK) of them). Each
program finds its document by a binary search over cu (``SEARCH_STEPS`` loads), returns at once past the
document's last block, then moves its pointers to the document's first rows and takes the document's
lengths as ``Nq`` and ``N_K``: from there on the kernel is the one of a single sequence, positions local.
Offsets are clamped to [0, TOTAL] as they are loaded, so no value of cu_seqlens makes a kernel read or
write outside q, k, v and the outputs (a bad one is reported by ``runtime/packed.py``'s check).
"""

from __future__ import annotations

from ...launch_spec import INT, TENSOR, Param, params
from ..lower import LoweredProgram

ROW_STRIDES = {
    "Q": "stride_qm",
    "Out": "stride_om",
    "O": "stride_om",
    "DO": "stride_dom",
    "DQuery": "stride_dqm",
    "K": "stride_kn",
    "V": "stride_vn",
    "DKey": "stride_dkn",
    "DValue": "stride_dvn",
}
"""Each row-indexed tensor parameter a kernel moves to its document, with its row stride."""


def packed_params(kernel: LoweredProgram) -> tuple[Param, ...]:
    """With ``varlen``: the document offsets (docs + 1,) of q and k, the number of documents and the binary
    search's steps (the kernels' ``Nq`` and ``N_K`` are then the packed totals)."""
    if not kernel.config.varlen:
        return ()
    return params(TENSOR, "CuQ", "CuK") + params(INT, "DOCS", "SEARCH_STEPS")


def _offset(cu: str, index: str, total: str) -> str:
    return f"tl.minimum(tl.maximum(tl.load({cu} + {index}).to(tl.int64), 0), {total}).to(tl.int32)"


def virtual_blocks(block: str, total: str) -> str:
    """The number of blocks a packed kernel's grid gives each head."""
    return f"({total} // {block} + DOCS)"


def document(pid: str, block: str, side: str, q_rows: tuple[str, ...], k_rows: tuple[str, ...]) -> str:
    """Code taking block ``pid`` of the grid (blocks of ``block`` rows of ``side``, "q" or "k") to its
    document: ``pid`` becomes the block's index in it, ``Nq`` and ``N_K`` its lengths, ``q_start`` its first
    row of q; the pointers ``q_rows`` and ``k_rows`` move to its first rows. Past its last block: return."""
    cu, total = ("CuQ", "TOTAL_Q") if side == "q" else ("CuK", "TOTAL_K")
    moves = "".join(f"{p} += q_start.to(tl.int64) * {ROW_STRIDES[p]}\n" for p in q_rows) + "".join(
        f"{p} += k_start.to(tl.int64) * {ROW_STRIDES[p]}\n" for p in k_rows
    )
    return (
        f"# packed sequences: find {pid}'s document (document i's blocks start at {cu}[i] // {block} + i)\n"
        "TOTAL_Q = Nq  # the packed totals; Nq and N_K become the document's lengths\nTOTAL_K = N_K\n"
        f"doc = {pid} * 0\ndoc_hi = doc + DOCS\nfor _ in range(0, SEARCH_STEPS):\n"
        "    mid = (doc + doc_hi) // 2\n"
        f"    below = {_offset(cu, 'mid', total)} // {block} + mid <= {pid}\n"
        "    doc = tl.where(below, mid, doc)\n    doc_hi = tl.where(below, doc_hi, mid)\n"
        f"q_start = {_offset('CuQ', 'doc', 'TOTAL_Q')}\n"
        f"k_start = {_offset('CuK', 'doc', 'TOTAL_K')}\n"
        f"Nq = tl.maximum({_offset('CuQ', 'doc + 1', 'TOTAL_Q')} - q_start, 0)\n"
        f"N_K = tl.maximum({_offset('CuK', 'doc + 1', 'TOTAL_K')} - k_start, 0)\n"
        f"{pid} -= {'q' if side == 'q' else 'k'}_start // {block} + doc\n"
        f"if {pid} * {block} >= {'Nq' if side == 'q' else 'N_K'}:\n    return\n" + moves
    )


def padded_start(q_start: str, block: str) -> str:
    """The first of document ``doc``'s rows (its first row of q: ``q_start``) in a layout of the packed rows where
    every document starts on a block of ``block`` rows: (q_start + doc * block) rounded down to a block, which
    leaves room for the documents before it (TMA reads a block of a row statistic from an aligned start)."""
    return f"({q_start} + doc * {block}) // {block} * {block}"


def lse_rows(kernel: LoweredProgram, head: str) -> str:
    """The offset of row 0 of ``head`` (batch x query head, an int64 expression) in the row statistics
    (Lse, Delta: (B, Hq, Nq)); packed: of its document's row 0 in (1, Hq, TOTAL_Q)."""
    if kernel.config.varlen:
        return f"{head} * TOTAL_Q + q_start"
    return f"{head} * Nq"
