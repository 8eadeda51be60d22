"""Which programs a template instance can run, read from what the lowered program declares it needs: never
from a combinator's name. Each check that fails gives the reason the kernel falls back to the generated one
(``attnfuse show`` prints it)."""

from __future__ import annotations

from ..fragment_lint import indices_read
from ..passes.codegen.common import split
from ..passes.codegen.loops import listing_mask
from ..passes.lower import LoweredProgram
from .dkdv_mods import stages_mods
from .forward_fp8 import FP8_TEMPLATE_DTYPES
from .gluon_text import row_rescale
from .pipeline import ROWS
from .tiles import DKDV_TILES, DQ_TILES, FORWARD_TILES

TEMPLATE_DTYPES = ("float16", "bfloat16")
FORWARD_DROPOUT_HEAD_DIMS = (64, 128)  # at 256, dropout's Philox rounds made ptxas spill in the key loop
FORWARD_FP8_HEAD_DIMS = (64, 128)


# A call's facts (``KernelConfig``'s), in words
_FACTS = {
    "kv_lens": "per-sequence key counts (kv_lens)",
    "paged": "a paged cache",
    "positions": "given positions (q_offset, k_offset)",
    "wide_positions": "positions from 2**30 on",
    "partial": "partial results over some of each row's keys",
    "varlen": "packed sequences (cu_seqlens)",
    "dropout": "attention dropout (dropout_p)",
}
# Those the forward template takes (``forward_facts.py``), and of them those the backward templates take; all three
# take dropout (``passes/codegen/dropout.py``), not combined with these nor with block lists
_FORWARD_FACTS = ("kv_lens", "positions", "varlen")
_BACKWARD_FACTS = ("varlen",)
# Where the dK/dV template takes a packed call reading a tensor at packed rows, in its staged score modifications
# (unstaged, at head dim 128 such a program spilled 132 bytes in its step loop); a mask reading one (a block mask
# over the packed row) it does not take
DKDV_PACKED_READER_HEAD_DIMS = (64, 128)


def _common_reason(
    kernel: LoweredProgram, template: str, tiles: dict, takes: tuple[str, ...] = (), dtypes: tuple[str, ...] = ()
) -> str | None:
    """Why the ``template`` template, with ``tiles`` by head dim, cannot run ``kernel`` for what every template
    refuses (its configuration but the facts it ``takes`` and the ``dtypes`` beyond float16 and bfloat16 it
    takes, a qk transform inside the kernel), or None."""
    c = kernel.config
    if c.arch != "sm90":
        return f"the templates are built for sm90 (Hopper), not {c.arch}"
    if c.dtype not in TEMPLATE_DTYPES + dtypes:
        if dtypes:
            return f"the {template} template takes {', '.join(TEMPLATE_DTYPES + dtypes)}, not {c.dtype}"
        return f"the templates take float16 and bfloat16, not {c.dtype}"
    if c.head_dim != c.head_dim_v:
        return f"the templates need D == DV (got {c.head_dim} and {c.head_dim_v})"
    if c.head_dim not in tiles:
        return f"the {template} template has tiles for head dims {', '.join(map(str, tiles))}, not {c.head_dim}"
    for fact, what in _FACTS.items():
        if getattr(c, fact) and fact not in takes:
            return f"the {template} template does not take {what} yet"
    if split(kernel):
        return "a qk transform applied inside the kernel (the template runs them hoisted into a pass)"
    return None


def block_list_reason(block_size: int | None) -> str | None:
    """Why the templates (forward, dK/dV) cannot follow, in a call, block lists of ``block_size`` (the listing
    mask's block size, ``Prepared.limit``; None: no listing mask), or None when they can: a forward program's
    query rows, and a dK/dV program's keys, must lie in one of the lists' blocks."""
    rows = 2 * ROWS.value
    if block_size is None or (block_size > 0 and block_size % rows == 0):
        return None
    return (
        f"the templates follow block lists whose block size is a multiple of {rows} (a program's query rows or "
        f"keys), not {block_size}"
    )


def _index_reader(kernel: LoweredProgram) -> str | None:
    """The first combinator application of ``kernel`` that reads q_idx or k_idx, or None."""
    for inst in kernel.instances():
        if indices_read(inst.apply):
            return inst.prefix
    return None


def forward_reason(kernel: LoweredProgram) -> str | None:
    """Why the forward template cannot run ``kernel``, or None when it can."""
    reason = _common_reason(
        kernel, "forward", FORWARD_TILES, takes=(*_FORWARD_FACTS, "dropout"), dtypes=FP8_TEMPLATE_DTYPES
    )
    if reason is not None:
        return reason
    c = kernel.config
    listing = listing_mask(kernel)
    fact = next((f for f in _FORWARD_FACTS if getattr(c, f)), None)
    if c.dtype in FP8_TEMPLATE_DTYPES:
        if c.head_dim not in FORWARD_FP8_HEAD_DIMS:
            dims = ", ".join(map(str, FORWARD_FP8_HEAD_DIMS))
            return f"the forward template takes float8 at head dims {dims}, not {c.head_dim}"
        if not kernel.normaliser.fragment.unit_weights:  # P·V rounds P · 256 to e4m3, whose range ends at 448
            return (
                f"{kernel.normaliser.prefix} does not declare unit_weights (weights at most 1), which the forward "
                "template's float8 P·V needs"
            )
    if listing is not None and fact is not None:
        return (
            f"{listing.prefix} lists its blocks, and the forward template follows block lists only in a call "
            f"without {_FACTS[fact]} (a listed program's loader, steps and careful redo take none of them)"
        )
    if c.dropout and listing is not None:
        return (
            f"{listing.prefix} lists its blocks, and the forward template does not take block lists with "
            f"{_FACTS['dropout']} yet"
        )
    if c.dropout and fact is not None:  # the template's dropout numbers rows and keys as a plain call's
        return f"the forward template does not take {_FACTS['dropout']} with {_FACTS[fact]} yet"
    if c.dropout and c.head_dim not in FORWARD_DROPOUT_HEAD_DIMS:
        return (
            f"the forward template takes {_FACTS['dropout']} at head dims "
            f"{', '.join(map(str, FORWARD_DROPOUT_HEAD_DIMS))}, not {c.head_dim}"
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
    """Why the dK/dV template cannot run ``kernel``, or None when it can (a listing mask's block size is checked
    in the call: ``block_list_reason``)."""
    reason = _backward_template_reason(kernel, "dK/dV", DKDV_TILES)
    c = kernel.config
    if reason is None and c.varlen and (reader := _index_reader(kernel)):
        staged = {m.prefix for m in kernel.mods} if stages_mods(kernel) else set()
        if c.head_dim not in DKDV_PACKED_READER_HEAD_DIMS or reader not in staged:
            dims = ", ".join(map(str, DKDV_PACKED_READER_HEAD_DIMS))
            return (
                f"{reader} reads q_idx or k_idx (a tensor at packed rows in a packed call), which the dK/dV template "
                f"takes only in a score modification it stages (dkdv_mods) at head dim {dims} (ptxas spilled in "
                "its step loop)"
            )
    return reason


def _backward_template_reason(kernel: LoweredProgram, template: str, tiles: dict) -> str | None:
    """Why the backward ``template`` (dK/dV or dQ, of ``tiles``) cannot run ``kernel``, or None: both take the
    same programs, dropout included, but not with block lists; and packed calls, as the forward template takes
    them (not with block lists, dropout or a tensor indexed by query and key)."""
    reason = _common_reason(kernel, template, tiles, takes=("dropout", *_BACKWARD_FACTS)) or _backward_reason(kernel)
    if reason is not None:
        return reason
    c = kernel.config
    listing = listing_mask(kernel)
    fact = next((f for f in _BACKWARD_FACTS if getattr(c, f)), None)
    if listing is not None and (c.dropout or fact is not None):
        return (
            f"{listing.prefix} lists its blocks, and the {template} template does not take block lists with "
            f"{_FACTS['dropout' if c.dropout else fact]} yet"
        )
    if fact is not None and c.dropout:
        return f"the {template} template does not take {_FACTS['dropout']} with {_FACTS[fact]} yet"
    return None


def dq_reason(kernel: LoweredProgram) -> str | None:
    """Why the dQ template cannot run ``kernel``, or None when it can: the programs the dK/dV template takes (a
    listing mask's block size is checked in the call: ``block_list_reason``)."""
    return _backward_template_reason(kernel, "dQ", DQ_TILES)


def _backward_reason(kernel: LoweredProgram) -> str | None:
    """Why a backward template (dK/dV, dQ) cannot run ``kernel``'s gradients, or None: a normaliser or score
    modification with no backward, or a normaliser that needs delta without saving lse."""
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
