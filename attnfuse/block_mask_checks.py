"""A ``BlockMask``'s fields, checked once, before any kernel can index keys by its lists.

A mask built by hand, copied or loaded from a file is untrusted: the kernels load the key (and query)
blocks its lists name, so an index past the grid would read outside k and v. ``checked`` checks the sizes,
shapes, dtypes and devices on the host, then the lists' values against ``active`` with tensor operations
on the mask's device and one host sync. Tensors checked (or derived by ``BlockMask.from_blocks``) are
remembered by identity and version, so rebuilding a mask from them, as the torch.compile op boundary does
on every call, costs no device work and no sync.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from .errors import InputError

TENSORS = (
    "active",
    "kv_num_blocks",
    "kv_indices",
    "q_num_blocks",
    "q_indices",
    "q_block_order",
    "kv_block_order",
    "partial_index",
    "partial_masks",
)

# id(active) -> (weak references to the seven tensors, their versions, (Nq, Nk, block_size, heavy)); an
# entry goes when its active tensor does
_remembered: dict[int, tuple] = {}


def versions(tensors) -> tuple[int, ...]:
    """The tensors' version counters (-1 for an inference tensor, which has none)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:  # an inference tensor
        return tuple(-1 if t.is_inference() else t._version for t in tensors)


def remember(tensors: tuple, sizes: tuple) -> None:
    """Record ``tensors`` (the seven, in ``TENSORS`` order) at their current versions as a valid mask."""
    key = id(tensors[0])
    forget = lambda _, key=key: _remembered.pop(key, None)  # noqa: E731
    _remembered[key] = ((weakref.ref(tensors[0], forget), *map(weakref.ref, tensors[1:])), versions(tensors), sizes)


def remembered(tensors: tuple, sizes: tuple) -> tuple[int, ...] | None:
    """The versions at which exactly these tensor objects, with these sizes (ints, not 64.0 or True), were
    remembered, or None."""
    record = _remembered.get(id(tensors[0]))
    if (
        record is None
        or record[2] != sizes
        or any(type(n) is not int for n in sizes)
        or any(r() is not t for r, t in zip(record[0], tensors))
    ):
        return None
    return record[1]


def checked(sizes: tuple, tensors: tuple) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The seven ``tensors`` (``TENSORS`` order) of a mask with these ``sizes`` (Nq, Nk, block_size,
    kv_heavy_blocks), inference tensors (which have no version counter) replaced by normal copies, and
    their versions, after raising InputError, naming the entry, unless they form a valid mask. Values
    are not checked on fake or meta tensors (tracing), which hold none."""
    for name, t in zip(TENSORS, tensors):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"block_mask.{name} must be a tensor, got {type(t).__name__}")
    now = versions(tensors)
    if remembered(tensors, sizes) == now:
        return tensors, now
    if -1 in now and any(t.is_inference() for t in tensors):
        with torch.inference_mode(False):
            tensors = tuple(t.clone() if t.is_inference() and not is_fake(t) else t for t in tensors)
    _check_metadata(sizes, dict(zip(TENSORS, tensors)))
    if not any(t.is_meta or is_fake(t) for t in tensors):
        _check_values(dict(zip(TENSORS, tensors)))
        remember(tensors, sizes)
    return tensors, versions(tensors)


def lengths(Nq: int, Nk: int) -> None:
    """Raise InputError unless Nq and Nk are positive ints."""
    for name, n in (("Nq", Nq), ("Nk", Nk)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"{name} must be a positive int, got {n!r}")


def _check_metadata(sizes: tuple, t: dict) -> None:
    Nq, Nk, block_size, heavy = sizes
    lengths(Nq, Nk)
    QB, KB = -(-Nq // block_size), -(-Nk // block_size)
    active = t["active"]
    if active.dim() != 4 or min(active.shape[:2]) < 1:
        raise InputError(
            f"block_mask.active must be a 4-D tensor (Bm, Hm, QB, KB) with Bm, Hm >= 1, got shape {tuple(active.shape)}"
        )
    if t["partial_masks"].dim() != 3:
        raise InputError(
            f"block_mask.partial_masks must be a 3-D bool tensor (P, block_size, block_size), got "
            f"shape {tuple(t['partial_masks'].shape)}"
        )
    Bm, Hm = active.shape[:2]
    expected = {
        "active": (torch.bool, (Bm, Hm, QB, KB), "(Bm, Hm, QB, KB)"),
        "kv_num_blocks": (torch.int32, (Bm, Hm, QB), "(Bm, Hm, QB)"),
        "kv_indices": (torch.int32, (Bm, Hm, QB, KB), "(Bm, Hm, QB, KB)"),
        "q_num_blocks": (torch.int32, (Bm, Hm, KB), "(Bm, Hm, KB)"),
        "q_indices": (torch.int32, (Bm, Hm, KB, QB), "(Bm, Hm, KB, QB)"),
        "q_block_order": (torch.int32, (QB,), "(QB,)"),
        "kv_block_order": (torch.int32, (KB,), "(KB,)"),
        "partial_index": (torch.int32, (Bm, Hm, QB, KB), "(Bm, Hm, QB, KB)"),
        "partial_masks": (
            torch.bool,
            (t["partial_masks"].shape[0], block_size, block_size),
            "(P, block_size, block_size)",
        ),
    }
    for name, (dtype, shape, dims) in expected.items():
        if t[name].dtype != dtype or tuple(t[name].shape) != shape:
            raise InputError(
                f"block_mask.{name} must be a {dtype} tensor {dims} = {shape} (QB = ceil(Nq / "
                f"block_size), KB = ceil(Nk / block_size)), got {t[name].dtype} {tuple(t[name].shape)}"
            )
        if t[name].device != active.device:
            raise InputError(
                f"block_mask.{name} is on {t[name].device}, block_mask.active on {active.device}: "
                f"a mask's tensors must share a device"
            )
    if isinstance(heavy, bool) or not isinstance(heavy, int) or not 0 <= heavy <= KB:
        raise InputError(f"block_mask.kv_heavy_blocks must be an int in [0, {KB}] (KB, the key blocks), got {heavy!r}")


Fault = tuple[torch.Tensor, Callable[[list[int]], str]]  # where a rule fails (bool), and its message at an index


def _check_values(t: dict) -> None:
    """Raise InputError at the first entry that breaks a rule: the rules' failures are found on the mask's
    device, then one host sync reads whether any failed."""
    active = t["active"]
    faults = [
        *_list_faults(t, "kv", "query", "key", active),
        *_list_faults(t, "q", "key", "query", active.transpose(-1, -2)),
        *_order_faults(t, "q_block_order"),
        *_order_faults(t, "kv_block_order"),
        *_partial_faults(t),
    ]
    failed = torch.stack([bad.any() for bad, _ in faults]).tolist()  # the one host sync
    for (bad, message), fails in zip(faults, failed):
        if fails:
            raise InputError(message(bad.nonzero()[0].tolist()))


def _at(index: list[int]) -> str:
    return f"[{', '.join(map(str, index))}]"


def _list_faults(t: dict, side: str, row: str, col: str, keep: torch.Tensor) -> list[Fault]:
    """The rules of one side's lists: ``{side}_num_blocks`` (Bm, Hm, R), the count each ``row`` block lists,
    in [0, C]; ``{side}_indices`` (Bm, Hm, R, C), its first count entries, the ``col`` blocks it lists: in
    [0, C), distinct, each active in ``keep`` (Bm, Hm, R, C) (active, or its transpose), and every active
    block listed. Entries past the count are never read and may hold anything."""
    num_name, idx_name = f"{side}_num_blocks", f"{side}_indices"
    num, idx = t[num_name], t[idx_name]
    C = idx.shape[-1]
    listed = torch.arange(C, device=idx.device) < num[..., None]
    inside = (idx >= 0) & (idx < C)
    counted = listed & inside
    cols = torch.where(counted, idx, 0).long()
    times = torch.zeros(idx.shape, dtype=torch.int32, device=idx.device).scatter_add_(-1, cols, counted.int())

    def entry(i: list[int]) -> str:  # block_mask.kv_indices[b, h, r, p] = c
        return f"block_mask.{idx_name}{_at(i)} = {int(idx[tuple(i)])}"

    def repeated(i: list[int]) -> str:
        c = int(idx[tuple(i)])
        return (
            f"{entry(i)} appears {int(times[tuple(i[:3] + [c])])} times in the list of {row} block {i[2]}; "
            f"its first {num_name}{_at(i[:3])} = {int(num[tuple(i[:3])])} entries must be distinct"
        )

    def inactive(i: list[int]) -> str:
        c = int(idx[tuple(i)])
        grid = i[:2] + ([c, i[2]] if side == "q" else [i[2], c])
        return (
            f"{entry(i)}: {row} block {i[2]} lists {col} block {c}, which block_mask.active{_at(grid)} marks inactive"
        )

    def miscounted(i: list[int]) -> str:
        return (
            f"block_mask.{num_name}{_at(i)} = {int(num[tuple(i)])}, but block_mask.active marks "
            f"{int(keep[tuple(i)].sum())} {col} blocks of {row} block {i[2]} active: the list must name each "
            f"of them once"
        )

    return [
        (
            (num < 0) | (num > C),
            lambda i: f"block_mask.{num_name}{_at(i)} = {int(num[tuple(i)])} is outside [0, {C}] (the {col} blocks)",
        ),
        (listed & ~inside, lambda i: f"{entry(i)} is outside [0, {C})"),
        (counted & (times.gather(-1, cols) > 1), repeated),
        (counted & ~keep.gather(-1, cols), inactive),
        (num != keep.sum(-1), miscounted),
    ]


def _order_faults(t: dict, name: str) -> list[Fault]:
    """An order (n,): a permutation of [0, n), each entry in range and distinct."""
    order = t[name]
    n = order.shape[0]
    inside = (order >= 0) & (order < n)
    slots = torch.where(inside, order, 0).long()
    times = torch.zeros(n, dtype=torch.int32, device=order.device).scatter_add_(0, slots, inside.int())
    return [
        (~inside, lambda i: f"block_mask.{name}{_at(i)} = {int(order[i[0]])} is outside [0, {n})"),
        (
            inside & (times.gather(0, slots) > 1),
            lambda i: (
                f"block_mask.{name}{_at(i)} = {int(order[i[0]])} appears {int(times[int(order[i[0]])])} times; "
                f"the order must be a permutation of [0, {n})"
            ),
        ),
    ]


def _partial_faults(t: dict) -> list[Fault]:
    """``partial_index`` (Bm, Hm, QB, KB): -1 (a block kept in full, or inactive) or an index into
    ``partial_masks`` (P, bs, bs), and -1 wherever ``active`` is False."""
    index, P = t["partial_index"], t["partial_masks"].shape[0]

    def entry(i: list[int]) -> str:
        return f"block_mask.partial_index{_at(i)} = {int(index[tuple(i)])}"

    return [
        (
            (index < -1) | (index >= P),
            lambda i: f"{entry(i)} is outside [-1, {P}) (-1, or one of the {P} partial_masks)",
        ),
        (
            (index != -1) & ~t["active"],
            lambda i: (
                f"{entry(i)} names a token mask for a block that block_mask.active{_at(i)} marks inactive; "
                f"it must be -1 there"
            ),
        ),
    ]
