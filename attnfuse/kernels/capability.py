"""Which programs a template instance can run, read from what the lowered program declares it needs: never
from a combinator's name. Each check that fails gives the reason the kernel falls back to the generated one
(``attnfuse show`` prints it)."""

from __future__ import annotations

from ..passes.codegen.common import split
from ..passes.lower import LoweredProgram
from .gluon_text import row_rescale
from .tiles import DKDV_TILES, FORWARD_TILES

TEMPLATE_DTYPES = ("float16", "bfloat16")
FORWARD_DROPOUT_HEAD_DIMS = (64, 128)  # at 256, dropout's Philox rounds made ptxas spill in the key loop


def _common_reason(kernel: LoweredProgram, template: str, tiles: dict) -> str | None:
    """Why the ``template`` template, with ``tiles`` by head dim, cannot run ``kernel`` for what every template
    refuses (its configuration, its masks' block lists, a qk transform inside the kernel), or None."""
    c = kernel.config
    if c.arch != "sm90":
        return f"the templates are built for sm90 (Hopper), not {c.arch}"
    if c.dtype not in TEMPLATE_DTYPES:
        return f"the templates take float16 and bfloat16, not {c.dtype}"
    if c.head_dim != c.head_dim_v:
        return f"the templates need D == DV (got {c.head_dim} and {c.head_dim_v})"
    if c.head_dim not in tiles:
        return f"the {template} template has tiles for head dims {', '.join(map(str, tiles))}, not {c.head_dim}"
    for fact, what in (
        (c.kv_lens, "per-sequence key counts (kv_lens)"),
        (c.paged, "a paged cache"),
        (c.positions, "given positions (q_offset, k_offset)"),
        (c.wide_positions, "positions from 2**30 on"),
        (c.partial, "partial results over some of each row's keys"),
        (c.varlen, "packed sequences (cu_seqlens)"),
    ):
        if fact:
            return f"the {template} template does not take {what} yet"
    if split(kernel):
        return "a qk transform applied inside the kernel (the template runs them hoisted into a pass)"
    listing = next((m for m in kernel.masks if m.fragment.block_list is not None), None)
    if listing is not None:
        return f"{listing.prefix} lists its blocks, and the template does not follow block lists yet"
    return None


def forward_reason(kernel: LoweredProgram) -> str | None:
    """Why the forward template cannot run ``kernel``, or None when it can."""
    reason = _common_reason(kernel, "forward", FORWARD_TILES)
    if reason is not None:
        return reason
    if kernel.config.dropout and kernel.config.head_dim not in FORWARD_DROPOUT_HEAD_DIMS:
        return (
            f"the forward template takes attention dropout (dropout_p) at head dims "
            f"{', '.join(map(str, FORWARD_DROPOUT_HEAD_DIMS))}, not {kernel.config.head_dim}"
        )
    norm = kernel.normaliser
    scaled = norm.fragment.scaled_update and norm.code(norm.fragment.scaled_update, factor="qk_scale")
    for update in filter(None, (norm.fragment.update, scaled)):
        if row_rescale(update, "rows") is None:
            return (
                f"the update of {norm.prefix} changes acc other than by a row factor (acc = acc * f[:, None]), "
                "which the template applies after the previous block's P·V"
            )
    return None


def dkdv_reason(kernel: LoweredProgram) -> str | None:
    """Why the dK/dV template cannot run ``kernel``, or None when it can."""
    reason = _common_reason(kernel, "dK/dV", DKDV_TILES)
    if reason is not None:
        return reason
    norm = kernel.normaliser
    if norm.fragment.grad is None:
        return f"{norm.prefix} declares no backward (its grad is None)"
    if norm.fragment.needs_delta and not norm.fragment.has_lse:
        return (
            f"{norm.prefix} needs delta but saves no lse: the template reads delta from the rows it makes of lse "
            "(runtime/template_rows.py)"
        )
    no_grad = next((m for m in kernel.mods if m.fragment.grad is None), None)
    if no_grad is not None:
        return f"{no_grad.prefix} declares no backward (its grad is None)"
    return None
