"""A thread-safe LRU bounded by bytes rather than entry count.

KV blobs differ in size by orders of magnitude (chunk length x model
geometry), so a count bound would either waste memory or thrash; the caller
states each value's size and the cache evicts least-recently-used values
until the total fits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

from ragkv.store.stats import LRUStats

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """LRU holding at most ``capacity_bytes`` (0 disables caching)."""

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be a non-negative int; got {capacity_bytes!r}")
        self._capacity = capacity_bytes
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._misses += 1
                return None
            self._items.move_to_end(key)
            self._hits += 1
            return item[0]

    def put(self, key: K, value: V, nbytes: int) -> None:
        """Insert or replace; a value larger than the whole cache is not kept."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int; got {nbytes!r}")
        with self._lock:
            self._remove(key)
            if nbytes > self._capacity:
                return
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            while self._bytes > self._capacity:
                _, (_, evicted) = self._items.popitem(last=False)
                self._bytes -= evicted
                self._evictions += 1

    def discard(self, key: K) -> None:
        with self._lock:
            self._remove(key)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __contains__(self, key: K) -> bool:
        with self._lock:
            return key in self._items

    def stats(self) -> LRUStats:
        with self._lock:
            return LRUStats(
                entries=len(self._items),
                bytes=self._bytes,
                capacity_bytes=self._capacity,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
            )

    def _remove(self, key: K) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= item[1]
