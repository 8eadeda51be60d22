"""``LRUCache``: a bounded, thread-safe cache that builds each missing value once.

Every in-process cache of traces, plans and kernels is one of these, with its size a named constant where
it is made (``program.py``, ``runtime/launch.py``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Iterator, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Building:
    """A value one thread is building; the others asking for its key wait for ``done``."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.done = threading.Event()
        self.built = False
        self.value = None


class LRUCache(Generic[K, V]):
    """At most ``size`` values by key; past that the least recently used is dropped, then ``on_evict()`` is
    called. ``get_or_build(key, build)`` builds a missing value once: while one thread builds it, others
    asking for that key wait for it; different keys build in parallel (no lock is held while building)."""

    def __init__(self, size: int, on_evict: Callable[[], None] | None = None):
        if size < 1:
            raise ValueError(f"LRUCache size must be at least 1, got {size}")
        self.size = size
        self._on_evict = on_evict
        self._values: OrderedDict[K, V] = OrderedDict()
        self._building: dict[K, _Building] = {}
        self._cleared = 0  # how many times clear() ran: a build started before the latest one is not kept
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def get_or_build(self, key: K, build: Callable[[], V]) -> V:
        """The value of ``key``, built by ``build()`` (not None) if missing. If ``build`` raises, the error
        goes to its caller, and a thread that was waiting for the value builds it again itself."""
        while True:
            with self._lock:
                value = self._values.get(key)
                if value is not None:
                    self._values.move_to_end(key)
                    return value
                building = self._building.get(key)
                if building is None:
                    building = self._building[key] = _Building()
                    cleared = self._cleared
                    break
            if building.owner == threading.get_ident():
                raise RuntimeError(f"cache key {key!r} is asked for while this thread builds its value")
            building.done.wait()
            if building.built:
                return building.value
        try:
            value = build()
        except BaseException:
            with self._lock:
                del self._building[key]
            building.done.set()
            raise
        with self._lock:
            del self._building[key]
            if cleared == self._cleared:
                self._values[key] = value
            evicted = len(self._values) > self.size
            if evicted:
                self._values.popitem(last=False)
        building.value, building.built = value, True
        building.done.set()
        if evicted and self._on_evict is not None:
            self._on_evict()
        return value

    def clear(self) -> None:
        """Forget every value; a build under way still returns its value to the threads asking, but it is not
        kept (it may be stale, e.g. built before a plugin registered new tile rules)."""
        with self._lock:
            self._values.clear()
            self._cleared += 1

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first (a snapshot)."""
        with self._lock:
            return iter(list(self._values))

    def __reversed__(self) -> Iterator[K]:
        with self._lock:
            return iter(list(reversed(self._values)))

    def __getitem__(self, key: K) -> V:
        """The value of ``key`` (its recency unchanged); KeyError if missing."""
        return self._values[key]

    def values(self) -> list[V]:
        """The values, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._values.values())
