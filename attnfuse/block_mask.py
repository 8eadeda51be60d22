"""Block masks for ``af.block_sparse``: which (query block, key block) pairs are active, in CSR form.

Only the (Nq/bs) x (Nk/bs) block grid is ever built, never an Nq x Nk element mask, so a 128k-token mask
with B and H broadcast takes a few MB. Blocks index query and key *indices* (not positions).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from attrs import field, fields, frozen

from .block_mask_checks import TENSORS, checked, lengths, remember, remembered, versions
from .errors import InputError


def _block_size(_, __, value: int) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise InputError(f"block_size must be a power of two >= 16, got {value!r}")


EDITED = ("block_mask: its tensors were edited in place after it was built (e.g. mask.active[...] = False), so "
          "its block lists no longer match them; build a new mask (af.BlockMask.from_blocks(active, Nq, Nk, "
          "block_size) or af.create_block_mask)")


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

    Every mask is checked when it is built, whether by ``from_blocks``, by this constructor, as a copy or
    loaded from a file (``block_mask_checks``): each list names its row's active blocks (in any order),
    each once; the orders are permutations; ``kv_heavy_blocks`` is in [0, KB]. Otherwise an InputError
    names the entry. Inference tensors given to the constructor are replaced by normal copies.

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
    _versions: tuple[int, ...] = field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        given = self.tensors()
        tensors, now = checked((self.Nq, self.Nk, self.block_size, self.kv_heavy_blocks), given)
        if tensors is not given:  # inference tensors copied
            for name, t in zip(TENSORS, tensors):
                object.__setattr__(self, name, t)
        object.__setattr__(self, "_versions", now)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The seven tensors, in ``TENSORS`` order."""
        return tuple(getattr(self, name) for name in TENSORS)

    def check_unchanged(self) -> None:
        """Raise InputError if a tensor of the mask was edited in place since it was built (or if it never
        was: an object unpickled without its state)."""
        try:
            now, built = versions(self.tensors()), self._versions
        except AttributeError:
            raise InputError("block_mask: this BlockMask has no fields (unpickled without its state?); build "
                             "a new mask") from None
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
        return {"Nq": self.Nq, "Nk": self.Nk, "block_size": self.block_size, "kv_heavy_blocks": self.kv_heavy_blocks,
                **dict(zip(TENSORS, self.tensors()))}

    def __setstate__(self, state: dict) -> None:
        """A copy or an unpickled mask, built (and so checked) by the constructor."""
        names = {"Nq", "Nk", "block_size", "kv_heavy_blocks", *TENSORS}
        if not isinstance(state, dict) or set(state) != names:
            raise InputError(f"a pickled BlockMask's state must be a dict of {sorted(names)}, got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        built = BlockMask(**state)
        for f in fields(BlockMask):
            object.__setattr__(self, f.name, getattr(built, f.name))

    @classmethod
    def from_blocks(cls, active: torch.Tensor, Nq: int, Nk: int, block_size: int = 128) -> "BlockMask":
        """From a boolean block grid (QB, KB), (H, QB, KB) or (B, H, QB, KB), copied: the mask does not
        change when ``active`` does."""
        _block_size(None, None, block_size)
        lengths(Nq, Nk)
        if not isinstance(active, torch.Tensor) or active.dtype != torch.bool or not 2 <= active.dim() <= 4:
            raise InputError("active must be a bool tensor (QB, KB), (H, QB, KB) or (B, H, QB, KB)")
        qb, kb = -(-Nq // block_size), -(-Nk // block_size)
        if tuple(active.shape[-2:]) != (qb, kb):
            raise InputError(f"active must end in (ceil(Nq/block_size), ceil(Nk/block_size)) = ({qb}, {kb}), "
                             f"got {tuple(active.shape)}")
        with torch.inference_mode(False):  # normal tensors: their version counters see edits in any mode
            active = active.reshape((1,) * (4 - active.dim()) + tuple(active.shape)).clone()
            kv_num, kv_idx = _csr(active)
            q_num, q_idx = _csr(active.transpose(-1, -2))
            q_totals, kv_totals = kv_num.sum(dim=(0, 1)), q_num.sum(dim=(0, 1))  # list lengths per block
            tensors = (active, kv_num, kv_idx, q_num, q_idx, _heaviest_first(q_totals), _heaviest_first(kv_totals))
        heavy = _heavy(kv_totals)
        remember(tensors, (Nq, Nk, block_size, heavy))  # derived here: nothing to check
        return cls(Nq=Nq, Nk=Nk, block_size=block_size, kv_heavy_blocks=heavy, **dict(zip(TENSORS, tensors)))

    def sparsity(self) -> float:
        """Fraction of blocks that are inactive."""
        return 1.0 - self.active.float().mean().item()

    def to_dense(self) -> torch.Tensor:
        """The element mask (Bm, Hm, Nq, Nk): for tests and small shapes only."""
        self.check_unchanged()
        bs = self.block_size
        dense = self.active.repeat_interleave(bs, dim=-2).repeat_interleave(bs, dim=-1)
        return dense[..., : self.Nq, : self.Nk]

    def __repr__(self) -> str:
        return (f"BlockMask(Nq={self.Nq}, Nk={self.Nk}, block_size={self.block_size}, "
                f"shape={tuple(self.active.shape)}, sparsity={self.sparsity():.1%})")


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


def create_block_mask(predicate: Callable, B: int | None, H: int | None, Nq: int, Nk: int,
                      block_size: int = 128, device: torch.device | str | None = None) -> BlockMask:
    """Evaluate ``predicate(b, h, q_block, kv_block)`` once over the block grid.

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
        raise InputError(f"the block predicate must return a bool tensor broadcastable to (B, H, QB, KB) = {grid}, "
                         f"got {type(result).__name__}") from None
    if active.dtype != torch.bool:
        raise InputError(f"the block predicate must return a bool tensor, got {active.dtype}")
    try:
        active = torch.broadcast_to(active, grid).contiguous()
    except RuntimeError:
        raise InputError(f"the block predicate must return a bool tensor broadcastable to (B, H, QB, KB) = {grid} "
                         f"(QB = ceil(Nq / block_size), KB = ceil(Nk / block_size)), got shape "
                         f"{tuple(active.shape)}") from None
    return BlockMask.from_blocks(active, Nq, Nk, block_size)
