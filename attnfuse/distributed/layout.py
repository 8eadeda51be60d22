"""How a sequence is split over the ranks of a group: layouts, ``shard`` and ``unshard``.

The sequence (N rows along one dim, dim 2 of (B, H, N, D)) is cut into equal chunks. ``"zigzag"``: 2W
chunks, rank r holding chunks r and 2W-1-r, so every rank gets as many of a causal mask's kept pairs as
any other (ring-flash-attention's load balance). ``"contiguous"``: W chunks, rank r holding chunk r, for
programs whose masks keep about as much in every chunk (no mask, or a sliding window).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import InputError

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def chunk_count(layout: str, world: int) -> int:
    """How many chunks the sequence is cut into."""
    return 2 * world if layout == "zigzag" else world


def rank_chunks(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in the order its shard holds them."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def group_of(group: Any) -> tuple[Any, int, int]:
    """(group, this process's rank in it, its size); InputError unless torch.distributed is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise InputError("attnfuse.distributed needs an initialised process group: call "
                         "torch.distributed.init_process_group first (torchrun sets its environment)")
    return group, dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, group: Any = None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's shard of ``x`` (every rank passes the whole tensor, e.g. (B, H, N, D)): its chunks of
    dim ``dim`` (N / W rows of it), joined, as a new contiguous tensor. InputError when N is not a multiple
    of the layout's chunk count (2W for "zigzag", W for "contiguous")."""
    layout = check_layout(layout)
    _, rank, world = group_of(group)
    n = x.shape[dim]
    chunks = chunk_count(layout, world)
    if n % chunks:
        raise InputError(f"shard: a sequence of {n} rows (dim {dim}) cannot be split by layout {layout!r} over "
                         f"{world} ranks: it needs a multiple of {chunks}")
    size = n // chunks
    return torch.cat([x.narrow(dim, c * size, size) for c in rank_chunks(layout, rank, world)], dim=dim)


def unshard(x_shard: torch.Tensor, group: Any = None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The whole tensor from every rank's shard (an all-gather; every rank gets it): the inverse of
    ``shard``. Every rank's shard must have the same shape (InputError otherwise)."""
    layout = check_layout(layout)
    group, rank, world = group_of(group)
    check_same(group, world, x_shard.device, {"shape": list(x_shard.shape)}, "unshard")
    per_rank = len(rank_chunks(layout, rank, world))
    if x_shard.shape[dim] % per_rank:
        raise InputError(f"unshard: a shard of {x_shard.shape[dim]} rows (dim {dim}) holds {per_rank} chunks "
                         f"(layout {layout!r}), so it needs a multiple of {per_rank}")
    parts = [torch.empty_like(x_shard) for _ in range(world)]
    dist.all_gather(parts, x_shard.contiguous(), group=group)
    size = x_shard.shape[dim] // per_rank
    chunks: dict[int, torch.Tensor] = {}
    for r, part in enumerate(parts):
        for i, c in enumerate(rank_chunks(layout, r, world)):
            chunks[c] = part.narrow(dim, i * size, size)
    return torch.cat([chunks[c] for c in range(chunk_count(layout, world))], dim=dim)


def check_same(group: Any, world: int, device: torch.device, values: dict[str, list[int]], what: str) -> None:
    """InputError on every rank unless every rank passes the same ``values`` (small non-negative ints by
    name, e.g. shapes): one all-gather of them."""
    flat = [v for name in values for v in values[name]]
    mine = torch.tensor(flat, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    if all(row == rows[0] for row in rows):
        return
    at = 0
    for name, value in values.items():
        seen = [row[at:at + len(value)] for row in rows]
        if any(s != seen[0] for s in seen):
            by_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
            raise InputError(f"{what}: every rank must give shards of equal size, but {name} differs ({by_rank}); "
                             f"attnfuse.distributed.shard gives each rank N / W rows of the sequence")
        at += len(value)
