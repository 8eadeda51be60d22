"""KV caches from a packed prefill: decoding goes on from a packed call's keys and values, one sequence per
document, through ``kv_lens`` (a contiguous cache) or ``kv_lens`` and a ``block_table`` (a paged one).

A packed call cannot decode (its documents share one row); these copy each document's rows into a cache of
its own, where any program decodes from them (README, "Decoding from a KV cache"). Positions carry over: a
document's key j is key j of its sequence, so RoPE and masks continue where the packed call left them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import InputError


class PackedCache(NamedTuple):
    """k, v caches of the documents and their lengths: contiguous, (docs, Hkv, capacity, D) and
    (docs, Hkv, capacity, DV), or a paged pool, (pages, page_size, Hkv, D) ("NHD") with ``block_table``
    (docs, pages a document) int32; ``kv_lens`` (docs,) int32."""

    k: torch.Tensor
    v: torch.Tensor
    kv_lens: torch.Tensor
    block_table: torch.Tensor | None = None


def _documents(k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed row's document (total,) and position in it (total,), int64, after checking the call's
    shapes and offsets (one host sync: the offsets' values)."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != 1:
            raise InputError(f"{name} must be a packed (1, Hkv, total, D) tensor, got {tuple(getattr(t, 'shape', ()))}")
    if k.shape[1:3] != v.shape[1:3]:
        raise InputError(f"k and v must have the same heads and rows, got {tuple(k.shape)} and {tuple(v.shape)}")
    ok = isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dtype in (torch.int32, torch.int64)
    if not ok or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise InputError("cu_seqlens must be a (docs + 1,) int32 or int64 tensor of offsets")
    total, values = k.shape[2], cu_seqlens.cpu().long()
    if values[0] != 0 or values[-1] != total or bool((values.diff() < 0).any()):
        raise InputError(
            f"cu_seqlens must rise from 0 to the packed length {total}, never falling; got {values.tolist()}"
        )
    offsets = values.to(k.device)
    lengths = offsets.diff()
    document = torch.repeat_interleave(torch.arange(lengths.numel(), device=k.device), lengths, output_size=total)
    return document, torch.arange(total, device=k.device) - offsets[document]


def packed_to_cache(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, capacity: int | None = None
) -> PackedCache:
    """A contiguous cache of each document of a packed call's k (1, Hkv, total, D) and v (1, Hkv, total, DV):
    k (docs, Hkv, capacity, D), v likewise, with document d's keys at rows [0, len_d) (the rest zero), and
    ``kv_lens`` its lengths. ``capacity`` (default: the longest document) leaves room for the keys decoding
    appends; below the longest document it is an InputError."""
    document, position = _documents(k, v, cu_seqlens)
    lengths = torch.bincount(document, minlength=cu_seqlens.numel() - 1)
    longest = int(lengths.max()) if lengths.numel() else 0
    capacity = longest if capacity is None else capacity
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < longest:
        raise InputError(f"capacity must be an int of at least the longest document's {longest} rows, got {capacity!r}")
    docs, Hkv = lengths.numel(), k.shape[1]
    caches = []
    for t in (k, v):
        cache = t.new_zeros(docs, capacity, Hkv, t.shape[3])  # rows first: one index_put of (total, Hkv, D)
        cache[document, position] = t[0].transpose(0, 1)
        caches.append(cache.transpose(1, 2))
    return PackedCache(caches[0], caches[1], lengths.to(torch.int32))


def packed_to_pages(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, page_size: int, spare_pages: int = 0
) -> PackedCache:
    """A paged cache ("NHD": pools (pages, page_size, Hkv, D) and (pages, page_size, Hkv, DV)) of each document
    of a packed call's k and v: document d gets ``ceil(len_d / page_size) + spare_pages`` pages, in order, listed
    in its ``block_table`` row (docs, most pages) int32 (unused entries 0, never read past ``kv_lens``)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InputError(f"page_size must be a positive int, got {page_size!r}")
    if isinstance(spare_pages, bool) or not isinstance(spare_pages, int) or spare_pages < 0:
        raise InputError(f"spare_pages must be an int >= 0, got {spare_pages!r}")
    document, position = _documents(k, v, cu_seqlens)
    lengths = torch.bincount(document, minlength=cu_seqlens.numel() - 1)
    pages = (lengths + page_size - 1) // page_size + spare_pages  # each document's
    first = torch.cumsum(pages, 0) - pages  # its first page
    most = int(pages.max()) if pages.numel() else 0
    slots = torch.arange(most, device=k.device)
    block_table = torch.where(slots < pages[:, None], first[:, None] + slots, 0).to(torch.int32)
    page = first[document] + position // page_size
    pools = []
    for t in (k, v):
        pool = t.new_zeros(int(pages.sum()), page_size, k.shape[1], t.shape[3])
        pool[page, position % page_size] = t[0].transpose(0, 1)
        pools.append(pool)
    return PackedCache(pools[0], pools[1], lengths.to(torch.int32), block_table)
