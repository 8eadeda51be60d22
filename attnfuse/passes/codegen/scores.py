"""The score pipeline of a key tile: the modifications' prologues, scale, modifications and masks, the
normaliser's update, and the guards that keep masked keys' non-finite values out of P·V."""

from __future__ import annotations

from ...errors import DECLARATION_CHECK
from ..lower import LoweredProgram
from .common import fragment
from .text import indent


def prologues(kernel: LoweredProgram) -> str:
    return "".join(
        f"# {m.prefix}: prologue\n{fragment(m.fragment.prologue)}\n" for m in kernel.mods if m.fragment.prologue
    )


def folded_scale(kernel: LoweredProgram) -> float | None:
    """The factor the normaliser's ``scaled_update`` folds into its exponent, when it can: no score
    modification needs the scaled scores, and the factor is positive (so it commutes with the row max and
    keeps a masked -inf at -inf). Then the update costs one multiply-add per score, as in FlashAttention."""
    factor = kernel.scale * kernel.score_factor
    if kernel.normaliser.fragment.scaled_update and not kernel.mods and factor > 0:
        return factor
    return None


def normaliser_update(kernel: LoweredProgram) -> str:
    """The normaliser's update of the forward's key loop, on the scores ``scores(..., fold=True)`` gives."""
    norm = kernel.normaliser
    factor = folded_scale(kernel)
    text = norm.fragment.update if factor is None else norm.code(norm.fragment.scaled_update, factor=repr(factor))
    return f"# {norm.prefix}: normaliser update\n{fragment(text)}\n{unit_weights_check(kernel)}"


def unit_weights_check(kernel: LoweredProgram) -> str:
    """After the update of a normaliser that declares ``unit_weights``: a device assertion that its weights ``p``
    are at most 1 in magnitude (or NaN). It runs where assertions run (Triton's interpreter, as
    ``runtime/interpreter.py`` launches; a GPU compile drops it), raising ``DeclarationViolation`` there."""
    norm = kernel.normaliser
    if not norm.fragment.unit_weights:
        return ""
    message = (
        f"{DECLARATION_CHECK}normaliser {norm.apply.combinator!r} declares unit_weights=True, but its update wrote "
        "a weight above 1 in magnitude"
    )
    return f"tl.device_assert((tl.abs(p) <= 1.0) | (p != p), {message!r})  # {norm.prefix}: its declaration\n"


def scores(
    kernel: LoweredProgram,
    masked: bool,
    rows_too: bool = False,
    stages: bool = False,
    implied: str | None = None,
    fold: bool = False,
) -> str:
    """The raw product ``s`` -> scaled, modified, masked scores as the normaliser takes them.

    ``stages``: keep ``s_<i>`` (the input of modification i) and ``s_nat`` (after the last) for the
    backward. ``rows_too``: the mask also excludes rows past Nq (the backward sums over rows).
    ``implied``: the prefix of a mask whose keep the loop already guarantees (it lists the blocks visited).
    ``fold``: leave the scale to the normaliser's ``scaled_update`` where ``folded_scale`` allows.
    """
    lines = []
    if kernel.mods:
        lines.append(f"s = s * {kernel.scale!r}")
        for i, m in enumerate(kernel.mods):
            if stages:
                lines.append(f"s_{i} = s")
            lines += [f"# {m.prefix}: score modification", fragment(m.fragment.body)]
        if stages:
            lines.append("s_nat = s")
        if kernel.score_factor != 1.0:
            lines.append(f"s = s * {kernel.score_factor!r}")
    elif not (fold and folded_scale(kernel) is not None):
        lines.append(f"s = s * {kernel.scale * kernel.score_factor!r}")
    if masked:
        keeps = (["q_ok[:, None]"] if rows_too else []) + ["k_ok[None, :]"]
        keeps += [f"({m.fragment.keep})" for m in kernel.masks if m.fragment.keep and m.prefix != implied]
        lines.append(f"keep = {' & '.join(keeps)}")
        for m in _partial_listing(kernel, implied):
            if kernel.config.dtype == "float32":
                # every tile: Triton 3.6 fails to lower (for a GPU) the `if` below in a float32 kernel
                lines.append(f"keep = keep & ({m.fragment.keep})  # {m.prefix}: its keep, in every listed block")
                continue
            lines += [
                "keep = tl.broadcast_to(keep, (BLOCK_M, BLOCK_N))",
                f"if list_partial:  # {m.prefix}: a partial listed block, masked element by element",
                f"    keep = keep & ({m.fragment.keep})",
            ]
        lines.append(f"s = tl.where(keep, s, {kernel.normaliser.fragment.masked_score})")
    return "\n".join(lines) + "\n" if lines else ""


def _partial_listing(kernel: LoweredProgram, implied: str | None) -> list:
    """The listing mask ``implied`` names, if its lists mark partial blocks (``BlockList.partial``): its keep
    still applies inside those (the loop defines ``list_partial``)."""
    return [
        m
        for m in kernel.masks
        if m.prefix == implied
        and m.fragment.keep
        and m.fragment.block_list is not None
        and m.fragment.block_list.partial is not None
    ]


def has_masks(kernel: LoweredProgram) -> bool:
    return any(m.fragment.keep for m in kernel.masks)


def masks_keys(kernel: LoweredProgram, masked: bool, implied: str | None = None) -> bool:
    """Whether a tile's ``keep`` can drop keys that lie in range (a mask's keep, beyond the loop's own)."""
    return masked and (
        any(m.fragment.keep and m.prefix != implied for m in kernel.masks) or bool(_partial_listing(kernel, implied))
    )


def masked_values(kernel: LoweredProgram) -> str:
    """The careful P·V of a masked tile, for ``poisoned_redo``: masked keys must not reach P·V (their weight
    is 0, but 0 · NaN is NaN), so the tile's non-finite values become 0, and a row that keeps a key whose
    value is non-finite gets NaN in that value's columns (as the math would; with several such keys in one
    tile, in the union of their columns). Only tiles with a non-finite value take the second branch."""
    return (
        'v_finite = tl.abs(v) < float("inf")  # false for NaN too\n'
        "if tl.max(tl.where(v_finite, 0, 1)) > 0:\n"
        "    key_bad = tl.max(tl.where(v_finite, 0, 1), axis=1)\n"
        "    row_bad = tl.max(tl.where(keep & (key_bad[None, :] > 0), 1, 0), axis=1)\n"
        "    col_bad = tl.max(tl.where(v_finite, 0, 1), axis=0)\n"
        '    acc = tl.where((row_bad[:, None] > 0) & (col_bad[None, :] > 0), float("nan"), acc)\n'
        "    v = tl.where(v_finite, v, 0.0)\n"
    )


def poisoned_redo(kernel: LoweredProgram, careful_loops: str) -> str:
    """After the key loops, which leave values as they are: a block whose accumulator is not finite (a masked
    key's NaN or inf reached it as 0 · NaN, or a kept key's did, or a sum overflowed) runs its keys again in
    ``careful_loops``, whose masked tiles take ``masked_values``. Testing every masked tile's values instead
    took v out of tl.dot's shared-memory path: sliding-window forwards ran 50% slower. Blocks whose inputs
    are finite pay one reduction of acc."""
    norm = kernel.normaliser.fragment
    return (
        "# A masked key's non-finite value reaches acc as 0 · NaN: such a block runs its keys again, masking\n"
        "# those values (rare: only non-finite inputs or overflowing sums get here)\n"
        'if tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1)) > 0:  # NaN too\n'
        + indent(
            f"acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype={kernel.accumulator})\n{fragment(norm.init)}\n" + careful_loops,
            4,
        )
        + "\n"
    )


def with_bounds(code: str) -> str:
    """Define ``in_bounds`` first when the code reads it."""
    return ("in_bounds = q_ok[:, None] & k_ok[None, :]\n" + code) if "in_bounds" in code else code
