"""Persistent chunk store on local disk (LMDB).

LMDB reads are served straight from the page cache through a memory map, so a
warm read costs one copy into the decode buffer.  The store lives in the
``"chunks"`` sub-database of a shared :class:`LMDBEnvironment`, next to the
other ragkv sub-databases in the same directory.

With ``capacity_bytes`` the chunks sub-database is kept at most that large: every write
transaction that would exceed it deletes chunks in the same transaction, those of the
tenant most above its fair share (below), and of its chunks the least recently used first
among those never read since they were written, then among the rest (segmented LRU,
:mod:`store.recency`; ``protected_share=0`` is plain LRU). Chunks this process read most recently
are never evicted, so one query's working set survives its own write-backs; an evicted
chunk is a plain miss, which the query path recomputes and puts back.

Each tenant's bytes (the tenant a key names) are counted in the same transaction as every
put, delete and eviction (:mod:`store.tenant_bytes`), so they hold across restarts;
:meth:`LMDBStore.recount` rebuilds them from a full scan. The same transaction bounds them:
a tenant a write takes past its budget evicts its own chunks, and a store over its capacity
evicts from the tenant holding most above its fair share (:mod:`store.lmdb_eviction`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

from ragkv.store.base import BlobStore, RawBlob, StoreUsage
from ragkv.store.lmdb_env import DEFAULT_MAP_SIZE, LMDBEnvironment
from ragkv.store.lmdb_eviction import ChunkEviction, pages_bytes
from ragkv.store.recency import (
    DEFAULT_PROTECTED_SHARE,
    LRU_DB,
    SEGMENT_DB,
    TENANT_LRU_DB,
    USE_DB,
    RecencyIndex,
    TouchLog,
    now_stamp,
)
from ragkv.store.tenant_budgets import TenantBudgets
from ragkv.store.tenant_bytes import TENANTS_DB, TenantBytes, scan_sizes

CHUNKS_DB = "chunks"
_KEY_BATCH = 1024  # keys listed per read transaction by iter_keys
_TOUCH_BATCH = 256  # reads remembered before their last-use stamps are written
_PINNED = 64  # most recently read chunks that eviction leaves alone (>= one query's top_k)


class LMDBStore(BlobStore):
    """Chunk store in the LMDB environment at ``path`` (a directory, created if missing
    unless ``create`` is false)."""

    backend = "lmdb"
    durable = True
    keeps_tenant_budgets = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        create: bool = True,
        mac_key: bytes | None = None,
        capacity_bytes: int | None = None,
        protected_share: float = DEFAULT_PROTECTED_SHARE,
    ) -> None:
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1
        ):
            raise ValueError(f"capacity_bytes must be a positive int or None; got {capacity_bytes!r}")
        if isinstance(protected_share, bool) or not isinstance(protected_share, (int, float)):
            raise ValueError(f"protected_share must be a number in [0, 1); got {protected_share!r}")
        if not 0 <= protected_share < 1:
            raise ValueError(f"protected_share must be in [0, 1) (0: plain LRU); got {protected_share!r}")
        self._capacity = capacity_bytes
        self._protected_share = float(protected_share)
        self._env = LMDBEnvironment(path, map_size=map_size, create=create)
        try:
            self._db = self._env.db(CHUNKS_DB)
            protected = int(protected_share * capacity_bytes) if capacity_bytes is not None else 0
            self._recency = RecencyIndex(
                self._env.db(USE_DB),
                self._env.db(LRU_DB),
                self._env.db(SEGMENT_DB),
                protected_bytes=protected,
                tenant_lru_db=self._env.db(TENANT_LRU_DB),
            )
            self._tenants = TenantBytes(self._env.db(TENANTS_DB))
            self._eviction = ChunkEviction(self._db, self._recency, self._tenants, capacity_bytes)
            self._env.write(self._recency.keep_tenant_order)
            if capacity_bytes is not None:
                self._env.write(lambda txn: self._recency.track_untracked(txn, self._db))
            self._env.write(self._count_if_uncounted)
        except BaseException:
            self._env.close()
            raise
        self._touches = TouchLog(_PINNED)
        super().__init__(mac_key=mac_key)

    @property
    def capacity_bytes(self) -> int | None:
        return self._capacity

    @property
    def protected_share(self) -> float:
        return self._protected_share

    @property
    def path(self) -> str:
        return self._env.path

    def __repr__(self) -> str:
        return f"LMDBStore({self._env.path!r})" if not self._closed else "LMDBStore(<closed>)"

    @property
    def tenant_budgets(self) -> TenantBudgets:
        return self._eviction.budgets

    def set_tenant_budgets(self, budgets: TenantBudgets) -> None:
        """Bound each tenant's bytes from the next write on (a tenant over its budget now is
        brought within it by its next write)."""
        if not isinstance(budgets, TenantBudgets):
            raise TypeError(f"budgets must be a TenantBudgets; got {type(budgets).__name__}")
        self._check_open()
        if budgets.any and self._capacity is None:
            self._env.write(lambda txn: self._recency.track_untracked(txn, self._db))
        self._eviction.budgets = budgets

    def tenant_bytes(self) -> dict[str, int]:
        """Blob bytes per tenant, as counted with every write (``""``: shared chunks)."""
        self._check_open()
        with self._env.read() as txn:
            return self._tenants.all(txn)

    def recount(self) -> dict[str, int]:
        """Rebuild the per-tenant counts from a full scan of the chunks; returns them."""
        self._check_open()
        return self._env.write(lambda txn: self._tenants.recount(txn, scan_sizes(txn, self._db)))

    def _count_if_uncounted(self, txn) -> None:
        if not self._tenants.kept(txn):
            self._tenants.recount(txn, scan_sizes(txn, self._db))

    def _get_raw_many(self, keys: list[bytes]) -> list[RawBlob | None]:
        with self._env.read() as txn:
            # The memoryviews die with the transaction: copy each hit out once.
            found = [None if (value := txn.get(key, db=self._db)) is None else bytearray(value) for key in keys]
        self._note_used([key for key, blob in zip(keys, found) if blob is not None])
        return found

    def _note_used(self, keys: list[bytes]) -> None:
        """Record reads of `keys` (also those an upper tier served from memory)."""
        if self._eviction.bounded and keys:
            if self._touches.record(keys) >= _TOUCH_BATCH:
                self._env.write(self._write_touches)

    def _put_raw_many(self, pairs: list[tuple[bytes, RawBlob]]) -> None:
        def put_all(txn) -> Counter[str]:
            stamp = now_stamp()
            for key, blob in pairs:
                old = txn.get(key, db=self._db)
                self._tenants.changed(txn, key, 0 if old is None else len(old), len(blob))
                txn.put(key, blob, db=self._db)
                self._recency.written(txn, key, stamp, len(blob))  # small puts; kept even without a capacity
            if not self._eviction.bounded:
                return Counter()
            self._write_touches(txn)
            written = frozenset(key for key, _ in pairs)
            return self._eviction.evict(txn, written, written | self._touches.pinned())

        self._count_tenant_evictions(self._env.write(put_all))

    def _delete_raw(self, key: bytes) -> bool:
        def delete(txn) -> bool:
            self._recency.forget(txn, key)
            return self._eviction.delete(txn, key)

        return self._env.write(delete)

    def _write_touches(self, txn) -> None:
        pending = self._touches.take()
        try:
            for key, stamp in pending.items():
                blob = txn.get(key, db=self._db)
                if blob is not None:  # not deleted since it was read
                    self._recency.used(txn, key, stamp, len(blob))
        except BaseException:
            self._touches.restore(pending)
            raise

    def _contains_raw(self, key: bytes) -> bool:
        with self._env.read() as txn:
            return txn.get(key, db=self._db) is not None

    def _size_raw(self, key: bytes) -> int | None:
        with self._env.read() as txn:
            value = txn.get(key, db=self._db)
            return None if value is None else len(value)

    def _usage(self) -> StoreUsage:
        with self._env.read() as txn:
            protected = self._recency.protected_bytes(txn) if self._capacity is not None else None
            return StoreUsage(
                entries=txn.stat(self._db)["entries"], bytes=pages_bytes(txn, self._db), protected_bytes=protected
            )

    def _iter_raw_keys(self, prefix: bytes) -> Iterator[bytes]:
        # Short read transactions, so a long listing never holds back map
        # growth or keeps old pages alive for the whole walk.
        start = prefix
        while True:
            with self._env.read() as txn:
                cursor = txn.cursor(db=self._db)
                batch = []
                if cursor.set_range(start):
                    for key in cursor.iternext(keys=True, values=False):
                        key = bytes(key)
                        if not key.startswith(prefix) or len(batch) == _KEY_BATCH:
                            break
                        batch.append(key)
            yield from batch
            if len(batch) < _KEY_BATCH:
                return
            start = batch[-1] + b"\x00"  # smallest key after the last one seen

    def _close(self) -> None:
        if self._eviction.bounded:
            self._env.write(self._write_touches)
        self._env.close()
