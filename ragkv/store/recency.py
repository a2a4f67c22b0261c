"""Use order of the chunks in an LMDB store, for segmented least-recently-used eviction.

Two segments, as in SLRU: a chunk enters *probation* when it is written and moves to the
*protected* segment the first time it is read back; eviction takes probation's least
recently used chunks first. So chunks that are written once and never used again (a passage
one prompt pasted, a chat history, a document nobody asks about) cannot push out the
chunks queries keep coming back to: under plain LRU they do, and a store's hit rate sinks
as one-off entries flood it (the decay seen in prefix-keyed KV caches). The protected
segment is bounded (``protected_share`` of the capacity): past it, its least recently used
chunk is demoted to probation's young end, so a popularity shift is followed within a few
store turnovers. ``protected_share=0`` is plain LRU.

Four small sub-databases beside the chunks: ``chunk_use`` maps a chunk key to its use
record, ``chunk_lru`` holds ``order + key`` so a cursor walks probation oldest first, then
the protected segment oldest first, ``chunk_tenant_lru`` the same entries behind the tenant
the key names (``tenant/``), so one tenant's oldest chunk is one seek away (per-tenant
budgets and fair shares evict by it), and ``chunk_segments`` holds the protected segment's
bytes. A probation record is the 8-byte stamp of its last use (the format stores written
before segments existed), so its order is the stamp; a protected record is ``0xff + stamp
+ size``, its order ``0xff + stamp`` (no wall-clock stamp starts with 0xff for centuries).
Stamps are wall-clock nanoseconds, so the order holds across processes and restarts. Reads
only remember what they touched (:class:`TouchLog`); the uses are written in one
transaction per batch, or with the next write, so a read never waits for a write
transaction of its own.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ragkv.store.keys import tenant_of

USE_DB = "chunk_use"
LRU_DB = "chunk_lru"
TENANT_LRU_DB = "chunk_tenant_lru"
SEGMENT_DB = "chunk_segments"
DEFAULT_PROTECTED_SHARE = 0.65
_STAMP = struct.Struct(">Q")  # big-endian, so byte order is time order
_SIZE = struct.Struct(">Q")
_PROTECTED = b"\xff"
_PROTECTED_BYTES = b"protected_bytes"
_TENANT_ORDER_KEPT = b"tenant_order"


def _tenant_prefix(tenant: str) -> bytes:
    return tenant.encode("ascii") + b"/"  # no tenant name holds a '/'


def now_stamp() -> bytes:
    return _STAMP.pack(time.time_ns())


@dataclass(frozen=True)
class Use:
    """One chunk's use record: its last use, and whether (with its size) it is protected."""

    stamp: bytes
    protected: bool = False
    size: int = 0

    @classmethod
    def decode(cls, raw: bytes) -> Use:
        if raw[:1] == _PROTECTED and len(raw) == 1 + _STAMP.size + _SIZE.size:
            return cls(raw[1 : 1 + _STAMP.size], True, _SIZE.unpack(raw[1 + _STAMP.size :])[0])
        return cls(raw[: _STAMP.size])

    def encode(self) -> bytes:
        return _PROTECTED + self.stamp + _SIZE.pack(self.size) if self.protected else self.stamp

    def order(self, key: bytes) -> bytes:
        return (_PROTECTED + self.stamp if self.protected else self.stamp) + key


def key_of_order(order: bytes) -> bytes:
    return order[1 + _STAMP.size :] if order[:1] == _PROTECTED else order[_STAMP.size :]


class RecencyIndex:
    """Reads and writes the four sub-databases inside a caller's transaction.

    ``protected_bytes`` bounds the protected segment (0: plain LRU, nothing is protected);
    without ``tenant_lru_db`` no per-tenant order is kept."""

    def __init__(
        self,
        use_db: object,
        lru_db: object,
        segment_db: object,
        protected_bytes: int = 0,
        tenant_lru_db: object | None = None,
    ) -> None:
        if isinstance(protected_bytes, bool) or not isinstance(protected_bytes, int) or protected_bytes < 0:
            raise ValueError(f"protected_bytes must be a non-negative int; got {protected_bytes!r}")
        self._use_db = use_db
        self._lru_db = lru_db
        self._segment_db = segment_db
        self._tenant_db = tenant_lru_db
        self._protected_cap = protected_bytes

    def written(self, txn, key: bytes, stamp: bytes, size: int) -> None:
        """A write of `key`: a new chunk starts in probation; a protected one stays there."""
        old = self._use(txn, key)
        if old is None:
            self._replace(txn, key, None, Use(stamp))
        elif stamp > old.stamp:
            self._replace(txn, key, old, Use(stamp, old.protected, size if old.protected else 0))

    def used(self, txn, key: bytes, stamp: bytes, size: int) -> None:
        """A read of `key` at `stamp`: it moves to the protected segment's young end."""
        old = self._use(txn, key)
        if old is not None and old.stamp >= stamp and (old.protected or not self._protected_cap):
            return  # another process recorded a later use
        latest = stamp if old is None else max(stamp, old.stamp)
        protect = self._protected_cap > 0
        self._replace(txn, key, old, Use(latest, protect, size if protect else 0))
        if protect:
            self._demote_over_cap(txn, stamp)

    def forget(self, txn, key: bytes) -> None:
        old = self._use(txn, key)
        if old is not None:
            self._replace(txn, key, old, None)

    def has(self, txn, key: bytes) -> bool:
        return txn.get(key, db=self._use_db) is not None

    def protected_bytes(self, txn) -> int:
        raw = txn.get(_PROTECTED_BYTES, db=self._segment_db)
        return 0 if raw is None else _SIZE.unpack(bytes(raw))[0]

    def pop_oldest_of(self, txn, tenant: str, keep: frozenset[bytes]) -> Iterator[bytes]:
        """Forget and yield the chunk keys of one tenant (the tenant their keys name),
        probation's least recently used first, then the protected segment's, skipping `keep`,
        for as long as the caller iterates (it deletes each chunk it is given)."""
        prefix = _tenant_prefix(tenant)
        cursor = txn.cursor(db=self._tenant_db)
        positioned = cursor.set_range(prefix)
        while positioned:
            entry = bytes(cursor.key())
            if not entry.startswith(prefix):
                return
            order = entry[len(prefix) :]
            key = key_of_order(order)
            if key in keep:
                positioned = cursor.next()
                continue
            cursor.delete()
            use = self._use(txn, key)
            if use is not None and use.order(key) == order:  # else a stale entry, now dropped
                txn.delete(order, db=self._lru_db)
                txn.delete(key, db=self._use_db)
                if use.protected:
                    self._add_protected(txn, -use.size)
                yield key
            positioned = bool(cursor.key())

    def keep_tenant_order(self, txn) -> int:
        """Build the per-tenant order from the use records once (a store written before it was
        kept); how many entries it added."""
        if self._tenant_db is None or txn.get(_TENANT_ORDER_KEPT, db=self._segment_db) is not None:
            return 0
        added = 0
        for key, raw in txn.cursor(db=self._use_db).iternext():
            key = bytes(key)
            txn.put(_tenant_prefix(tenant_of(key)) + Use.decode(bytes(raw)).order(key), b"", db=self._tenant_db)
            added += 1
        txn.put(_TENANT_ORDER_KEPT, b"1", db=self._segment_db)
        return added

    def track_untracked(self, txn, chunks_db: object) -> int:
        """Give chunks with no recorded use (written before recency was kept) the oldest stamp."""
        oldest = _STAMP.pack(0)
        added = 0
        for key in txn.cursor(db=chunks_db).iternext(keys=True, values=False):
            if not self.has(txn, bytes(key)):
                self._replace(txn, bytes(key), None, Use(oldest))
                added += 1
        return added

    def _use(self, txn, key: bytes) -> Use | None:
        raw = txn.get(key, db=self._use_db)
        return None if raw is None else Use.decode(bytes(raw))

    def _replace(self, txn, key: bytes, old: Use | None, new: Use | None) -> None:
        tenant = None if self._tenant_db is None else _tenant_prefix(tenant_of(key))
        if old is not None:
            txn.delete(old.order(key), db=self._lru_db)
            if tenant is not None:
                txn.delete(tenant + old.order(key), db=self._tenant_db)
        if new is None:
            txn.delete(key, db=self._use_db)
        else:
            txn.put(key, new.encode(), db=self._use_db)
            txn.put(new.order(key), b"", db=self._lru_db)
            if tenant is not None:
                txn.put(tenant + new.order(key), b"", db=self._tenant_db)
        delta = (new.size if new is not None and new.protected else 0) - (old.size if old and old.protected else 0)
        if delta:
            self._add_protected(txn, delta)

    def _add_protected(self, txn, delta: int) -> None:
        total = max(0, self.protected_bytes(txn) + delta)
        txn.put(_PROTECTED_BYTES, _SIZE.pack(total), db=self._segment_db)

    def _demote_over_cap(self, txn, stamp: bytes) -> None:
        """Move the protected segment's least recently used chunks to probation's young end
        until the segment fits its bound."""
        while self.protected_bytes(txn) > self._protected_cap:
            cursor = txn.cursor(db=self._lru_db)
            if not cursor.set_range(_PROTECTED):
                return
            key = key_of_order(bytes(cursor.key()))
            old = self._use(txn, key)
            if old is None or not old.protected:  # an order entry without its record: drop it
                cursor.delete()
                continue
            self._replace(txn, key, old, Use(max(stamp, old.stamp)))


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
