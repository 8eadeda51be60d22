"""The forward kernel: FlashAttention-2 with an online normaliser, one program per query block and head.

Key blocks are visited in up to three loops: a masked head, an unmasked middle that every row keeps in
full, and a masked tail; blocks no row keeps are never visited.
"""

from __future__ import annotations

import string

from ...launch_spec import INT, TENSOR, Param, params, strides
from ..lower import LoweredProgram
from .common import constexpr_params, dv_mask, kernel_source, kv_params, masked_load, precision, qkv_strides
from .text import indent
from .dropout import dropout_setup, dropped_weights
from .loops import HEAD_GROUP, every_block, key_range, listing_mask, query_block, visit
from .fp8 import descales, fp8_constexprs, fp8_params, out_descale, score_descale, value_tile, weights_dtype
from .packed import lse_rows
from .operands import key_masked, key_offsets, key_rows, kv_base, operand, qk_product
from .scores import masked_values, masks_keys, normaliser_update, poisoned_redo, prologues, scores, with_bounds

_KERNEL = string.Template("""\
    # One program per (query block, batch x query head).
$query_block$q_load$prologues
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=$acc_dtype)
$norm_init
    # Keys [lo, hi) can be kept by some row of this block; [full_lo, full_hi) by all of them.
$key_range
    k_base = $k_base
    v_base = $v_base
$loops
$norm_finalize
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + q_idx[:, None] * stride_om + dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_ok[:, None]$dv_mask)
$store_lse""")


def key_tile(kernel: LoweredProgram, masked: bool, implied: str | None = None, careful: bool = False) -> str:
    """One step of the key loop: load the k tile (transformed), scores, normaliser update, then P·V. With
    EVEN_K, ``k_ok`` is constant true and Triton drops the masks of the loads. ``careful``: a masked tile
    keeps its masked keys' non-finite values out of P·V (see ``poisoned_redo``)."""
    masked = key_masked(kernel, masked)
    v = masked_load(
        "v_base + v_off[:, None] + dv[None, :] * stride_vd", "k_ok[:, None]" if masked else "", dv_mask(kernel)
    )
    score = scores(kernel, masked, implied=implied, fold=True) + normaliser_update(kernel)
    return (
        key_rows(kernel, "start_n")
        + key_offsets(kernel)
        + with_bounds(
            operand(kernel, "k", "k_base", "k_off[:, None]", "k_pos", "k_ok", "stride_kd", masked)
            + qk_product(kernel)
            + score_descale(kernel)
            + score
        )
        + dropped_weights(kernel)
        + value_tile(kernel, v)
        + (masked_values(kernel) if careful and masks_keys(kernel, masked, implied) else "")
        + f"acc = tl.dot(p.to({weights_dtype(kernel)}), v, acc{precision(kernel)})\n"
    )


def key_loops(kernel: LoweredProgram) -> str:
    """The forward's key loops, then ``poisoned_redo`` where a tile can mask keys."""

    def visited(careful: bool) -> str:
        return visit(
            kernel,
            lambda masked, implied: key_tile(kernel, masked, implied, careful),
            "start_n",
            "BLOCK_N",
            "pid_m * BLOCK_M",
        )

    listing = listing_mask(kernel)
    if not masks_keys(kernel, True, listing and listing.prefix):
        return visited(False)
    careful = (
        visited(True)
        if listing
        else every_block(lambda masked: key_tile(kernel, masked, None, True), "start_n", "BLOCK_N")
    )
    return visited(False) + poisoned_redo(kernel, careful)


def forward_params(kernel: LoweredProgram) -> tuple[Param, ...]:
    """The forward kernel's parameters, in order."""
    return (
        params(TENSOR, "Q", "K", "V", "Out", "Lse")
        + qkv_strides()
        + strides("o", "bhmd", "Out")
        + params(INT, "HQ", "Nq", "N_K", HEAD_GROUP)
        + kv_params(kernel)
        + kernel.args()
        + fp8_params(kernel)
        + constexpr_params(kernel, even_keys=True, even_queries=True)
        + fp8_constexprs(kernel)
    )


def generate_forward(kernel: LoweredProgram, name: str, parameters: tuple[Param, ...]) -> str:
    """Triton source of the forward kernel (one undecorated function ``name`` taking ``parameters``)."""
    norm = kernel.normaliser.fragment
    mask = dv_mask(kernel)
    store_lse = ""
    if kernel.config.save_lse:
        rows = lse_rows(kernel, "pid_bh.to(tl.int64)")
        store_lse = indent(f"tl.store(Lse + {rows} + q_idx, lse, mask=q_ok)", 4)
    return kernel_source(
        kernel,
        "forward kernel",
        name,
        parameters,
        _KERNEL.substitute(
            acc_dtype=kernel.accumulator,
            query_block=indent(query_block(kernel, even_queries=True, moved=(("Q", "Out"), ("K", "V"))), 4),
            k_base=kv_base(kernel, "k"),
            v_base=kv_base(kernel, "v"),
            q_load=indent(
                operand(kernel, "q", "q_base", "q_idx[:, None] * stride_qm", "q_pos", "q_ok", "stride_qd", True), 4
            ),
            prologues=indent(descales(kernel) + prologues(kernel) + dropout_setup(kernel), 4),
            norm_init=indent(norm.init, 4),
            key_range=indent(key_range(kernel), 4),
            loops=indent(key_loops(kernel), 4),
            norm_finalize=indent(norm.finalize, 4) + indent(out_descale(kernel), 4),
            dv_mask=f" & {mask}" if mask else "",
            store_lse=store_lse,
        ),
    )
