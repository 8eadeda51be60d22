"""Device tensors a plugin computes once and keeps across calls (rope's cos/sin tables, alibi's slopes).

A kept tensor must not live in a CUDA graph's memory pool: ``torch.compile(mode="reduce-overhead")`` runs its
warm-up and its capture with every allocation of the calling thread routed to the graph's private pool, and a
tensor made there and kept would be overwritten by the graph's later allocations (cudagraph trees refuse it:
"tensor(s) in the cudagraph pool not tracked as outputs"). ``device_cached`` therefore makes them on a worker
thread and its own stream, which no graph pool serves. During a capture it makes them inside the graph and
keeps nothing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Hashable, TypeVar

import torch

from .lru import LRUCache

__all__ = ["device_cached", "clear_device_cache"]

T = TypeVar("T")
MAX_ENTRIES = 64
_kept: LRUCache[tuple, Any] = LRUCache(MAX_ENTRIES)
_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnfuse-device-cache")


def device_cached(key: Hashable, make: Callable[[], T], device: torch.device) -> T:
    """``make()`` (a tensor or a tuple of tensors on ``device``), computed on first use of ``key`` (once, when
    threads ask at once) and kept (the ``MAX_ENTRIES`` most recently used keys). ``key`` must hold everything
    ``make`` depends on."""
    entry = (key, torch.device(device))
    found = _kept.get(entry)
    if found is not None:
        return found
    if entry[1].type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return make()
        return _kept.get_or_build(entry, lambda: made_outside_graph_pools(make, entry[1]))
    return _kept.get_or_build(entry, make)


def clear_device_cache() -> None:
    """Forget every kept tensor."""
    _kept.clear()


def made_outside_graph_pools(make: Callable[[], T], device: torch.device) -> T:
    """``make()`` run by the worker thread on its own stream, ordered after the current stream's work so far
    and before its later work."""
    current = torch.cuda.current_stream(device)
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    side.wait_stream(current)

    def run() -> T:
        with torch.cuda.device(device), torch.cuda.stream(side):
            return make()

    made = _worker.submit(run).result()
    current.wait_stream(side)
    for tensor in made if isinstance(made, tuple) else (made,):
        tensor.record_stream(current)  # freed on eviction only after the current stream's uses
    return made
