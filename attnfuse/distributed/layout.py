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
from .agree import agree

LAYOUTS = ("zigzag", "contiguous")
_LAYOUT = "_attnfuse_layout"  # the attribute of a shard that records its layout


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
        raise InputError(
            "attnfuse.distributed needs an initialised process group: call "
            "torch.distributed.init_process_group first (torchrun sets its environment)"
        )
    return group, dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, group: Any = None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's shard of ``x`` (every rank passes the whole tensor, e.g. (B, H, N, D)): its chunks of
    dim ``dim`` (N / W rows of it), joined, as a new contiguous tensor that records ``layout`` (``layout_of``),
    so that a ring or ``unshard`` of another layout refuses it. InputError when N is not a multiple of the
    layout's chunk count (2W for "zigzag", W for "contiguous")."""
    layout = check_layout(layout)
    _, rank, world = group_of(group)
    check_dim(x, dim, "shard: dim", "x")
    n = x.shape[dim]
    chunks = chunk_count(layout, world)
    if n % chunks:
        raise InputError(
            f"shard: a sequence of {n} rows (dim {dim}) cannot be split by layout {layout!r} over "
            f"{world} ranks: it needs a multiple of {chunks}"
        )
    size = n // chunks
    return with_layout(
        torch.cat([x.narrow(dim, c * size, size) for c in rank_chunks(layout, rank, world)], dim=dim), layout
    )


def unshard(x_shard: torch.Tensor, group: Any = None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The whole tensor from every rank's shard (an all-gather; every rank gets it): the inverse of
    ``shard``. Every rank's shard must have the same shape, and one that records a layout (``shard``'s, the
    ring's out) must record ``layout``: an InputError on every rank otherwise, as for any bad shard."""
    group, rank, world = group_of(group)
    try:
        layout = check_layout(layout)
        check_shard_layout(x_shard, layout, "unshard", "x_shard")
        check_dim(x_shard, dim, "unshard: dim", "x_shard")
        check_chunks(x_shard, dim, layout, rank, world, "unshard")
        facts, failure = {"the shard's shape": list(x_shard.shape)}, None
    except Exception as exc:  # every rank must hear of it, whatever it is
        facts, failure = None, exc
    agree(group, world, facts, failure, "unshard", "every rank must give a shard of the same shape")
    return gather(x_shard, group, layout, dim)


def gather(x_shard: torch.Tensor, group: Any, layout: str, dim: int) -> torch.Tensor:
    """``unshard`` once every rank's shard is known to be good and of the same shape (no check)."""
    _, rank, world = group_of(group)
    parts = [torch.empty_like(x_shard) for _ in range(world)]
    dist.all_gather(parts, x_shard.contiguous(), group=group)
    size = x_shard.shape[dim] // len(rank_chunks(layout, rank, world))
    chunks: dict[int, torch.Tensor] = {}
    for r, part in enumerate(parts):
        for i, c in enumerate(rank_chunks(layout, r, world)):
            chunks[c] = part.narrow(dim, i * size, size)
    return torch.cat([chunks[c] for c in range(chunk_count(layout, world))], dim=dim)


def with_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x``, recording that it is a shard of ``layout`` (an attribute of this tensor object: a tensor made
    from it, a view or a copy, records nothing)."""
    setattr(x, _LAYOUT, layout)
    return x


def layout_of(x: Any) -> str | None:
    """The layout ``x`` records as a shard (``shard``'s result, the ring's out and lse), or None."""
    return getattr(x, _LAYOUT, None)


def check_shard_layout(x: Any, layout: str, what: str, name: str) -> None:
    """InputError when ``x`` records a layout other than ``layout``: its rows are other chunks of the sequence
    than the ones ``layout`` places there, which would give wrong results silently."""
    given = layout_of(x)
    if given is not None and given != layout:
        raise InputError(
            f"{what}: {name} is a shard of layout {given!r}, but this {what} uses layout {layout!r}; "
            f"shard with layout={layout!r}, or use layout={given!r} here"
        )


def check_chunks(x_shard: torch.Tensor, dim: int, layout: str, rank: int, world: int, what: str) -> None:
    """InputError unless dim ``dim`` of ``x_shard`` splits into the chunks rank ``rank`` holds."""
    per_rank = len(rank_chunks(layout, rank, world))
    if x_shard.shape[dim] % per_rank:
        raise InputError(
            f"{what}: a shard of {x_shard.shape[dim]} rows (dim {dim}) holds {per_rank} chunks "
            f"(layout {layout!r}), so it needs a multiple of {per_rank}"
        )


def check_dim(x: torch.Tensor, dim: Any, argument: str, name: str) -> None:
    """InputError unless ``dim`` is an int dim of ``x`` (-x.dim() to x.dim() - 1)."""
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise InputError(
            f"{argument} must be a dim of {name} ({tuple(x.shape)}, so from {-x.dim()} to {x.dim() - 1}), got {dim!r}"
        )
