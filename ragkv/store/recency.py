"""Last-use order of the chunks in an LMDB store, for least-recently-used eviction.

Two small sub-databases beside the chunks: ``chunk_use`` maps a chunk key to the stamp
of its last use, ``chunk_lru`` holds ``stamp + key`` so a cursor walks chunks oldest
first. Stamps are wall-clock nanoseconds, so the order holds across processes and
restarts. Reads only remember what they touched (:class:`TouchLog`); the stamps are
written in one transaction per batch, or with the next write, so a read never waits
for a write transaction of its own.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator

USE_DB = "chunk_use"
LRU_DB = "chunk_lru"
_STAMP = struct.Struct(">Q")  # big-endian, so byte order is time order


def now_stamp() -> bytes:
    return _STAMP.pack(time.time_ns())


class RecencyIndex:
    """Reads and writes the two sub-databases inside a caller's transaction."""

    def __init__(self, use_db: object, lru_db: object) -> None:
        self._use_db = use_db
        self._lru_db = lru_db

    def touch(self, txn, key: bytes, stamp: bytes) -> None:
        old = txn.get(key, db=self._use_db)
        if old is not None:
            if bytes(old) >= stamp:  # another process recorded a later use
                return
            txn.delete(bytes(old) + key, db=self._lru_db)
        txn.put(key, stamp, db=self._use_db)
        txn.put(stamp + key, b"", db=self._lru_db)

    def forget(self, txn, key: bytes) -> None:
        old = txn.get(key, db=self._use_db)
        if old is not None:
            txn.delete(bytes(old) + key, db=self._lru_db)
            txn.delete(key, db=self._use_db)

    def has(self, txn, key: bytes) -> bool:
        return txn.get(key, db=self._use_db) is not None

    def pop_oldest(self, txn, keep: frozenset[bytes]) -> Iterator[bytes]:
        """Forget and yield chunk keys, least recently used first, skipping `keep`, for as
        long as the caller iterates (it deletes each chunk it is given)."""
        cursor = txn.cursor(db=self._lru_db)
        positioned = cursor.first()
        while positioned:
            key = bytes(cursor.key())[_STAMP.size :]
            if key in keep:
                positioned = cursor.next()
                continue
            cursor.delete()  # moves the cursor to the next entry
            txn.delete(key, db=self._use_db)
            yield key
            positioned = bool(cursor.key())

    def track_untracked(self, txn, chunks_db: object) -> int:
        """Give chunks with no recorded use (written before recency was kept) the oldest stamp."""
        oldest = _STAMP.pack(0)
        added = 0
        for key in txn.cursor(db=chunks_db).iternext(keys=True, values=False):
            if not self.has(txn, bytes(key)):
                self.touch(txn, bytes(key), oldest)
                added += 1
        return added


class TouchLog:
    """What this process read since the last flush, and the keys it read most recently.

    The recent keys are pinned: eviction never takes them, so a query that has just
    loaded its chunks (and now writes back the ones it had to recompute) cannot evict
    what it is about to use.
    """

    def __init__(self, pinned: int) -> None:
        self._lock = threading.Lock()
        self._pending: dict[bytes, bytes] = {}
        self._recent: deque[bytes] = deque(maxlen=pinned)

    def record(self, keys: Iterable[bytes]) -> int:
        """Note a use of `keys`; returns how many uses wait to be written."""
        stamp = now_stamp()
        with self._lock:
            for key in keys:
                self._pending[key] = stamp
                self._recent.append(key)
            return len(self._pending)

    def take(self) -> dict[bytes, bytes]:
        with self._lock:
            pending, self._pending = self._pending, {}
            return pending

    def restore(self, pending: dict[bytes, bytes]) -> None:
        """Put back uses whose write failed, so they are written with the next batch."""
        with self._lock:
            for key, stamp in pending.items():
                self._pending.setdefault(key, stamp)

    def pinned(self) -> frozenset[bytes]:
        with self._lock:
            return frozenset(self._recent)
