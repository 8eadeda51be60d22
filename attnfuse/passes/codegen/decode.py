"""The split-KV decoding kernel (phase one of two): for few queries (Nq <= 16) and long caches.

One program per (split of the keys, batch x kv head, block of rows), where the rows are every query of
every query head of the kv head's GQA group, so K and V are read once for the whole group. Each program
runs the forward's key loop over its split and writes a partial (out, lse) per row; phase two (the
runtime's combine kernel) merges the splits. Per-row data (``h``) is a (BLOCK_M, 1) column here. Rows may
span several blocks of a block-listing mask, so here it masks element by element instead.
"""

from __future__ import annotations

import string

from ...launch_spec import INT, TENSOR, Param, params
from ..lower import LoweredProgram, masked_head
from .common import columns, constexpr_params, dv_mask, kernel_source, kv_params, qkv_strides
from .text import indent
from .loops import every_block, key_range, loops
from .operands import kv_base, kv_length, operand, position
from .scores import masks_keys, poisoned_redo, prologues
from .forward import key_tile

_KERNEL = string.Template("""\
    # One program per (split of the keys, batch x kv head, block of rows); row r is query r % Nq of the
    # group's query head r // Nq, so the whole group shares each K and V tile. Grid (splits, heads, row
    # blocks), or past 65535 heads (splits, y, z * row blocks) with y * z heads.
    pid_s = tl.program_id(0)
    row_blocks = tl.cdiv(GROUP * Nq, BLOCK_M)
    pid_r = tl.program_id(2) % row_blocks
    pid_bh = tl.program_id(1) + tl.program_id(2) // row_blocks * tl.num_programs(1)
    HKV = HQ // GROUP
    b = pid_bh // HKV
    hk = pid_bh % HKV
$kv_length    r = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = r < GROUP * Nq
    q_idx = r % Nq
    q_head = hk * GROUP + tl.minimum(r // Nq, GROUP - 1)
    h = q_head[:, None]
    q_pos = $q_pos
$columns    q_base = Q + b.to(tl.int64) * stride_qb
$q_load$prologues
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=$acc_dtype)
$norm_init
    q_lo = $q_lo
    q_hi = $q_hi
$key_range
    k_base = $k_base
    v_base = $v_base
$loops
$norm_finalize
    part = ((b * HQ + q_head).to(tl.int64) * Nq + q_idx) * NUM_SPLITS + pid_s
    tl.store(PartOut + part[:, None] * DV + dv[None, :], out, mask=q_ok[:, None]$dv_mask)
$store_lse""")


def decode_params(kernel: LoweredProgram) -> tuple[Param, ...]:
    """The split-KV kernel's parameters, in order."""
    return (
        params(TENSOR, "Q", "K", "V", "PartOut", "PartLse")
        + qkv_strides()
        + params(INT, "HQ", "Nq", "N_K")
        + kv_params(kernel)
        + params(INT, "SPLIT", "NUM_SPLITS")
        + kernel.args()
        + constexpr_params(kernel, even_keys=True)
    )


def _key_loops(kernel: LoweredProgram) -> str:
    """The forward's key loops over this program's split, then ``poisoned_redo`` where a tile can mask keys
    (every mask masks element by element here)."""
    fast = loops(lambda masked: key_tile(kernel, masked), "start_n", "BLOCK_N", masked_head(kernel.masks))
    if not masks_keys(kernel, True):
        return fast
    return fast + poisoned_redo(
        kernel, every_block(lambda masked: key_tile(kernel, masked, careful=True), "start_n", "BLOCK_N")
    )


def generate_decode(kernel: LoweredProgram, name: str, parameters: tuple[Param, ...]) -> str:
    """Triton source of the split-KV kernel; its normaliser must say how splits combine."""
    norm = kernel.normaliser.fragment
    mask = dv_mask(kernel)
    store_lse = "    tl.store(PartLse + part, lse, mask=q_ok)\n" if norm.combine == "logsumexp" else ""
    return kernel_source(
        kernel,
        "split-KV decoding kernel",
        name,
        parameters,
        _KERNEL.substitute(
            acc_dtype=kernel.accumulator,
            kv_length=indent(kv_length(kernel), 4),
            columns=indent(columns(kernel), 4),
            q_load=indent(
                operand(
                    kernel,
                    "q",
                    "q_base",
                    "q_head[:, None].to(tl.int64) * stride_qh + q_idx[:, None] * stride_qm",
                    "q_pos",
                    "q_ok",
                    "stride_qd",
                    True,
                ),
                4,
            ),
            q_pos=position(kernel, "q_idx + (Nk - Nq)"),
            q_lo=position(kernel, "Nk - Nq"),
            q_hi=position(kernel, "Nk - 1"),
            prologues=indent(prologues(kernel), 4),
            norm_init=indent(norm.init, 4),
            key_range=indent(key_range(kernel, ("pid_s * SPLIT", "tl.minimum(pid_s * SPLIT + SPLIT, Nk)")), 4),
            k_base=kv_base(kernel, "k"),
            v_base=kv_base(kernel, "v"),
            loops=indent(_key_loops(kernel), 4),
            norm_finalize=indent(norm.finalize, 4),
            dv_mask=f" & {mask}" if mask else "",
            store_lse=store_lse,
        ),
    )
