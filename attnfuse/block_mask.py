"""Block masks for ``af.block_sparse``: which (query block, key block) pairs are active, in CSR form, and
the token masks of the partial blocks.

A mask holds the (Nq/bs) x (Nk/bs) block grid, plus one bs x bs token mask per distinct partial block
(``create_block_mask``: a token-level predicate cut by the grid), never an Nq x Nk element mask: a
128k-token causal mask with B and H broadcast takes a few MB. Blocks index query and key *indices* (not
positions).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from attrs import field, fields, frozen

from .block_mask_checks import TENSORS, checked, lengths, remember, remembered, versions
from .errors import InputError, deprecated


def _block_size(_, __, value: int) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise InputError(f"block_size must be a power of two >= 16, got {value!r}")


EDITED = (
    "block_mask: its tensors were edited in place after it was built (e.g. mask.active[...] = False), so "
    "its block lists no longer match them; build a new mask (af.BlockMask.from_blocks(active, Nq, Nk, "
    "block_size) or af.create_block_mask)"
)


@frozen(kw_only=True, eq=False)
class BlockMask:
    """Active blocks of a (B, H, Nq, Nk) attention, B and H possibly broadcast (size 1).

    ``active`` (Bm, Hm, QB, KB) bool, QB = ceil(Nq / block_size), KB = ceil(Nk / block_size).
    Row CSR (forward and dQ): ``kv_num_blocks`` (Bm, Hm, QB) int32 and ``kv_indices`` (Bm, Hm, QB, KB)
    int32, the active key blocks of each query block first (``from_blocks``: ascending; the entries past
    a row's count are never read). Column CSR (dK, dV): ``q_num_blocks`` (Bm, Hm, KB) and ``q_indices``
    (Bm, Hm, KB, QB).
    Schedule: ``q_block_order`` (QB,) int32, the query blocks by how many key blocks they list over all
    batches and heads, most first, the order the forward and dQ kernels run them in (the longest rows
    start first, so none is left running alone at the end); ``kv_block_order`` (KB,) the same for key
    blocks (dK/dV). ``kv_heavy_blocks``: how many key blocks, first in that order, list at least twice
    the mean number of query blocks (global tokens' columns): the dK/dV kernel spreads each of them over
    the query heads of a GQA group, so one program does not run a group's long lists alone.
    Partial blocks: ``partial_index`` (Bm, Hm, QB, KB) int32, -1 for a block kept in full (or inactive),
    else the index of its token mask in ``partial_masks`` (P, block_size, block_size) bool, whose element
    [i, j] keeps query ``qb * block_size + i`` and key ``kb * block_size + j`` (identical token masks are
    stored once). Left out of the constructor: no partial block.

    Every mask is checked when it is built, whether by ``from_blocks``, by this constructor, as a copy or
    loaded from a file (``block_mask_checks``): each list names its row's active blocks (in any order),
    each once; the orders are permutations; ``kv_heavy_blocks`` is in [0, KB]; ``partial_index`` is -1 or
    a token mask's index, and -1 on inactive blocks. Otherwise an InputError names the entry. Inference
    tensors given to the constructor are replaced by normal copies.

    A mask is a value: ``from_blocks`` copies the grid it is given. Editing one of its tensors in place
    afterwards (``mask.active[...] = False``), in any mode (inference mode too), makes every later use (a
    launch, the reference, ``to_dense``, a copy) raise an InputError asking for a new mask, rather than
    silently running the old lists. (Re-deriving on use instead would hide device reductions and a host
    sync in a launch, and change a mask other calls may share.) The check reads the tensors' version
    counters: no work. Copies (``copy``, ``deepcopy``, pickle, ``torch.save``/``torch.load``, with
    ``weights_only=True`` once ``BlockMask`` is in ``torch.serialization``'s safe globals) are rebuilt
    through the constructor, so checked.
    """

    __attnfuse_runtime_input__ = True

    Nq: int
    Nk: int
    block_size: int = field(validator=_block_size)
    active: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    q_block_order: torch.Tensor
    kv_block_order: torch.Tensor
    kv_heavy_blocks: int
    partial_index: torch.Tensor | None = None
    partial_masks: torch.Tensor | None = None
    _versions: tuple[int, ...] = field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if (self.partial_index is None) != (self.partial_masks is None):
            raise InputError("block_mask: give partial_index and partial_masks together, or neither (no partial block)")
        if self.partial_index is None and isinstance(self.active, torch.Tensor):
            with torch.inference_mode(False):
                object.__setattr__(
                    self,
                    "partial_index",
                    torch.full(self.active.shape, -1, dtype=torch.int32, device=self.active.device),
                )
                object.__setattr__(
                    self,
                    "partial_masks",
                    torch.zeros(0, self.block_size, self.block_size, dtype=torch.bool, device=self.active.device),
                )
        given = self.tensors()
        tensors, now = checked((self.Nq, self.Nk, self.block_size, self.kv_heavy_blocks), given)
        if tensors is not given:  # inference tensors copied
            for name, t in zip(TENSORS, tensors):
                object.__setattr__(self, name, t)
        object.__setattr__(self, "_versions", now)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The mask's tensors, in ``TENSORS`` order."""
        return tuple(getattr(self, name) for name in TENSORS)

    def check_unchanged(self) -> None:
        """Raise InputError if a tensor of the mask was edited in place since it was built (or if it never
        was: an object unpickled without its state)."""
        try:
            now, built = versions(self.tensors()), self._versions
        except AttributeError:
            raise InputError(
                "block_mask: this BlockMask has no fields (unpickled without its state?); build a new mask"
            ) from None
        if now != built:
            raise InputError(EDITED)

    @classmethod
    def rebuilt(cls, sizes: tuple, tensors: Sequence[torch.Tensor]) -> "BlockMask":
        """A mask's ``sizes`` (Nq, Nk, block_size, kv_heavy_blocks) and ``tensors`` (``TENSORS`` order), as
        the op boundary passes them on every call, back into a mask: an InputError if they are a mask's,
        edited since it was built."""
        tensors, sizes = tuple(tensors), tuple(sizes)
        seen = remembered(tensors, sizes)
        if seen is not None and seen != versions(tensors):
            raise InputError(EDITED)
        Nq, Nk, block_size, heavy = sizes
        return cls(Nq=Nq, Nk=Nk, block_size=block_size, kv_heavy_blocks=heavy, **dict(zip(TENSORS, tensors)))

    def __getstate__(self) -> dict:
        self.check_unchanged()
        return {
            "Nq": self.Nq,
            "Nk": self.Nk,
            "block_size": self.block_size,
            "kv_heavy_blocks": self.kv_heavy_blocks,
            **dict(zip(TENSORS, self.tensors())),
        }

    def __setstate__(self, state: dict) -> None:
        """A copy or an unpickled mask, built (and so checked) by the constructor."""
        names = {"Nq", "Nk", "block_size", "kv_heavy_blocks", *TENSORS}
        partial = {"partial_index", "partial_masks"}  # a mask saved before masks had partial blocks lacks them
        if not isinstance(state, dict) or set(state) not in (names, names - partial):
            raise InputError(
                f"a pickled BlockMask's state must be a dict of {sorted(names)}, got "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}"
            )
        built = BlockMask(**state)
        for f in fields(BlockMask):
            object.__setattr__(self, f.name, getattr(built, f.name))

    @classmethod
    def from_blocks(cls, active: torch.Tensor, Nq: int, Nk: int, block_size: int = 128) -> "BlockMask":
        """From a boolean block grid (QB, KB), (H, QB, KB) or (B, H, QB, KB), copied: the mask does not
        change when ``active`` does. Every active block is kept in full."""
        _block_size(None, None, block_size)
        lengths(Nq, Nk)
        if not isinstance(active, torch.Tensor) or active.dtype != torch.bool or not 2 <= active.dim() <= 4:
            raise InputError("active must be a bool tensor (QB, KB), (H, QB, KB) or (B, H, QB, KB)")
        qb, kb = -(-Nq // block_size), -(-Nk // block_size)
        if tuple(active.shape[-2:]) != (qb, kb):
            raise InputError(
                f"active must end in (ceil(Nq/block_size), ceil(Nk/block_size)) = ({qb}, {kb}), "
                f"got {tuple(active.shape)}"
            )
        with torch.inference_mode(False):
            active = active.reshape((1,) * (4 - active.dim()) + tuple(active.shape))
            no_partial = (
                torch.full(active.shape, -1, dtype=torch.int32, device=active.device),
                torch.zeros(0, block_size, block_size, dtype=torch.bool, device=active.device),
            )
        return cls._derived(active, *no_partial, Nq, Nk, block_size)

    @classmethod
    def _derived(
        cls,
        active: torch.Tensor,
        partial_index: torch.Tensor,
        partial_masks: torch.Tensor,
        Nq: int,
        Nk: int,
        block_size: int,
    ) -> "BlockMask":
        """The mask of a grid ``active`` (Bm, Hm, QB, KB) and its partial blocks (see the class), copied; its
        lists are derived here, so there is nothing to check."""
        with torch.inference_mode(False):  # normal tensors: their version counters see edits in any mode
            active = active.clone()
            kv_num, kv_idx = _csr(active)
            q_num, q_idx = _csr(active.transpose(-1, -2))
            q_totals, kv_totals = kv_num.sum(dim=(0, 1)), q_num.sum(dim=(0, 1))  # list lengths per block
            tensors = (
                active,
                kv_num,
                kv_idx,
                q_num,
                q_idx,
                _heaviest_first(q_totals),
                _heaviest_first(kv_totals),
                partial_index.clone(),
                partial_masks.clone(),
            )
        heavy = _heavy(kv_totals)
        remember(tensors, (Nq, Nk, block_size, heavy))
        return cls(Nq=Nq, Nk=Nk, block_size=block_size, kv_heavy_blocks=heavy, **dict(zip(TENSORS, tensors)))

    def sparsity(self) -> float:
        """Fraction of blocks that are inactive."""
        return 1.0 - self.active.float().mean().item()

    def partial_blocks(self) -> int:
        """How many active blocks (over the grid's batches and heads) keep only some of their pairs."""
        return int((self.partial_index >= 0).sum().item())

    def to_dense(self) -> torch.Tensor:
        """The element mask (Bm, Hm, Nq, Nk): for tests and small shapes only."""
        self.check_unchanged()
        bs = self.block_size
        Bm, Hm, QB, KB = self.active.shape
        blocks = self.active[..., None, None].expand(Bm, Hm, QB, KB, bs, bs).clone()
        partial = self.partial_index >= 0
        blocks[partial] = self.partial_masks[self.partial_index[partial].long()]
        dense = blocks.transpose(3, 4).reshape(Bm, Hm, QB * bs, KB * bs)
        return dense[..., : self.Nq, : self.Nk]

    def __repr__(self) -> str:
        return (
            f"BlockMask(Nq={self.Nq}, Nk={self.Nk}, block_size={self.block_size}, "
            f"shape={tuple(self.active.shape)}, sparsity={self.sparsity():.1%}, "
            f"partial_blocks={self.partial_blocks()})"
        )


def _csr(active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the last two dims: the count of active columns, and their indices first, ascending."""
    counts = active.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~active).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts, order


def _heaviest_first(totals: torch.Tensor) -> torch.Tensor:
    """Blocks by their list length (``totals`` (n,), summed over batches and heads), longest first, ties
    in block order: (n,) int32."""
    return torch.argsort(totals, descending=True, stable=True).to(torch.int32)


def _heavy(totals: torch.Tensor) -> int:
    """How many blocks have a list length (``totals`` (n,)) of at least twice the mean, and not zero."""
    return int(((totals >= 2 * totals.float().mean()) & (totals > 0)).sum().item())


CHUNK_ELEMENTS = 1 << 24
"""``create_block_mask`` evaluates the predicate on as many query-block rows at a time as keep its result
(B', H', rows, Nk) within this many elements (at least one row of blocks)."""

MOVED = (
    "af.create_block_mask now evaluates its predicate per token, (b, h, q_idx, kv_idx), as flex_attention's "
    "create_block_mask does, and keeps the token-level mask inside partial blocks; it used to take block "
    "indices (b, h, q_block, kv_block). For a predicate of block indices, call "
    "af.create_block_mask_from_blocks(predicate, B, H, Nq, Nk, block_size=...) instead (same arguments). "
    "Changed 2026-12-05; this notice goes away in the next release"
)


def create_block_mask(
    mask_mod: Callable,
    B: int | None,
    H: int | None,
    Nq: int | None = None,
    Nk: int | None = None,
    block_size: int | None = None,
    device: torch.device | str | None = None,
    *,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    BLOCK_SIZE: int | tuple[int, int] | None = None,
) -> BlockMask:
    """A block mask from a token-level predicate, as ``torch.nn.attention.flex_attention.create_block_mask``.

    ``mask_mod(b, h, q_idx, kv_idx)`` gets broadcastable int64 tensors b (B', 1, 1, 1), h (1, H', 1, 1),
    q_idx (1, 1, rows, 1) and kv_idx (1, 1, 1, Nk) (B' = 1 when B is None, likewise H) and returns which
    pairs are kept, a bool tensor broadcastable to (B', H', rows, Nk). It is called once per chunk of
    query-block rows (``CHUNK_ELEMENTS``), so the whole Nq x Nk mask is never built. A block with no kept
    pair is skipped, a block with every pair kept runs with no mask arithmetic, and a partial block keeps
    exactly its kept pairs: its token mask is stored (identical ones once) and read by the kernels.
    ``Q_LEN``, ``KV_LEN`` and ``BLOCK_SIZE`` (an int, or a (q, kv) pair of equal sizes) are flex's names
    for ``Nq``, ``Nk`` and ``block_size`` (default 128). The mask lives on ``device`` (default: the CPU).
    """
    deprecated(("create_block_mask", "token-level"), MOVED, stacklevel=2)
    Nq = _one_of("Nq", Nq, "Q_LEN", Q_LEN)
    Nk = _one_of("Nk", Nk, "KV_LEN", KV_LEN)
    block_size = _one_of("block_size", block_size, "BLOCK_SIZE", _square(BLOCK_SIZE))
    block_size = 128 if block_size is None else block_size
    _block_size(None, None, block_size)
    lengths(Nq, Nk)
    bs, Bp, Hp = block_size, _batch("B", B), _batch("H", H)
    QB, KB = -(-Nq // bs), -(-Nk // bs)
    b = torch.arange(Bp, device=device).view(-1, 1, 1, 1)
    h = torch.arange(Hp, device=device).view(1, -1, 1, 1)
    kv_idx = torch.arange(Nk, device=device).view(1, 1, 1, -1)
    cols = (Nk - torch.arange(KB, device=device) * bs).clamp(max=bs)  # (KB,) keys in each key block
    step = max(1, CHUNK_ELEMENTS // (Bp * Hp * bs * Nk))
    actives, indices, masks, stored = [], [], [], 0
    for r0 in range(0, QB, step):
        rows = torch.arange(r0 * bs, min((r0 + step) * bs, Nq), device=device)
        keep = _kept(mask_mod(b, h, rows.view(1, 1, -1, 1), kv_idx), (Bp, Hp, len(rows), Nk))
        R = -(-len(rows) // bs)
        tiles = torch.nn.functional.pad(keep, (0, KB * bs - Nk, 0, R * bs - len(rows)))
        tiles = tiles.view(Bp, Hp, R, bs, KB, bs).transpose(3, 4)  # (B', H', R, KB, bs, bs)
        kept = tiles.sum(dim=(-1, -2))
        present = (len(rows) - torch.arange(R, device=device) * bs).clamp(max=bs)[:, None] * cols  # (R, KB)
        partial = (kept > 0) & (kept < present)
        index = torch.full(kept.shape, -1, dtype=torch.int32, device=device)
        index[partial] = torch.arange(stored, stored + int(partial.sum()), dtype=torch.int32, device=device)
        actives.append(kept > 0)
        indices.append(index)
        masks.append(tiles[partial])
        stored += masks[-1].shape[0]
    masks, index = torch.cat(masks), torch.cat(indices, dim=2)
    if stored:  # identical token masks (a causal mask's diagonal blocks) stored once
        unique, inverse = torch.unique(masks.view(stored, bs * bs), dim=0, return_inverse=True)
        partial = index >= 0
        masks, index[partial] = unique.view(-1, bs, bs), inverse.to(torch.int32)[index[partial].long()]
    return BlockMask._derived(torch.cat(actives, dim=2), index, masks, Nq, Nk, bs)


def _one_of(name: str, value, flex_name: str, flex_value):
    """``value``, or flex's keyword for it; an InputError if both are given."""
    if value is not None and flex_value is not None:
        raise InputError(f"create_block_mask: give {name} or {flex_name} (flex_attention's name for it), not both")
    return flex_value if value is None else value


def _square(size):
    """flex's BLOCK_SIZE: an int, or a (q, kv) pair, which must be equal here."""
    if isinstance(size, (tuple, list)):
        if len(size) != 2 or size[0] != size[1]:
            raise InputError(
                f"create_block_mask: BLOCK_SIZE must be an int or a (q, kv) pair of equal sizes (the "
                f"blocks are square), got {size!r}"
            )
        return size[0]
    return size


def _batch(name: str, value: int | None) -> int:
    """B or H: None (broadcast: 1) or a positive int."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"create_block_mask: {name} must be a positive int or None (broadcast), got {value!r}")
    return value


def _kept(result, shape: tuple) -> torch.Tensor:
    """A predicate's result as a bool tensor ``shape``, or an InputError saying what it must be."""
    what = f"a bool tensor broadcastable to (B', H', rows, Nk) = {shape}"
    if not isinstance(result, torch.Tensor) or result.dtype != torch.bool:
        raise InputError(
            f"the mask_mod of create_block_mask must return {what}, got "
            f"{result.dtype if isinstance(result, torch.Tensor) else type(result).__name__}"
        )
    try:
        return torch.broadcast_to(result, shape)
    except RuntimeError:
        raise InputError(
            f"the mask_mod of create_block_mask must return {what}, got shape {tuple(result.shape)}"
        ) from None


def create_block_mask_from_blocks(
    predicate: Callable,
    B: int | None,
    H: int | None,
    Nq: int,
    Nk: int,
    block_size: int = 128,
    device: torch.device | str | None = None,
) -> BlockMask:
    """A block mask from a block-level predicate: ``predicate(b, h, q_block, kv_block)``, evaluated once over
    the block grid, marks whole blocks active (every pair of an active block is kept).

    The predicate gets broadcastable int64 tensors b (B', 1, 1, 1), h (1, H', 1, 1), q_block (1, 1, QB, 1)
    and kv_block (1, 1, 1, KB) — B' = 1 when B is None, likewise H — and returns which blocks are active.
    """
    _block_size(None, None, block_size)
    lengths(Nq, Nk)
    qb, kb = -(-Nq // block_size), -(-Nk // block_size)
    b = torch.arange(B or 1, device=device).view(-1, 1, 1, 1)
    h = torch.arange(H or 1, device=device).view(1, -1, 1, 1)
    q_block = torch.arange(qb, device=device).view(1, 1, -1, 1)
    kv_block = torch.arange(kb, device=device).view(1, 1, 1, -1)
    grid = (B or 1, H or 1, qb, kb)
    result = predicate(b, h, q_block, kv_block)
    try:
        active = torch.as_tensor(result, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(
            f"the block predicate must return a bool tensor broadcastable to (B, H, QB, KB) = {grid}, "
            f"got {type(result).__name__}"
        ) from None
    if active.dtype != torch.bool:
        raise InputError(f"the block predicate must return a bool tensor, got {active.dtype}")
    try:
        active = torch.broadcast_to(active, grid).contiguous()
    except RuntimeError:
        raise InputError(
            f"the block predicate must return a bool tensor broadcastable to (B, H, QB, KB) = {grid} "
            f"(QB = ceil(Nq / block_size), KB = ceil(Nk / block_size)), got shape "
            f"{tuple(active.shape)}"
        ) from None
    return BlockMask.from_blocks(active, Nq, Nk, block_size)
