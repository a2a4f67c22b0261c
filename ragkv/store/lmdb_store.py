"""Persistent chunk store on local disk (LMDB).

LMDB reads are served straight from the page cache through a memory map, so a
warm read costs one copy into the decode buffer.  The store lives in the
``"chunks"`` sub-database of a shared :class:`LMDBEnvironment`, next to the
other ragkv sub-databases in the same directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ragkv.store.base import BlobStore, RawBlob, Usage
from ragkv.store.lmdb_env import DEFAULT_MAP_SIZE, LMDBEnvironment

CHUNKS_DB = "chunks"
_KEY_BATCH = 1024  # keys listed per read transaction by iter_keys


class LMDBStore(BlobStore):
    """Chunk store in the LMDB environment at ``path`` (a directory, created if missing
    unless ``create`` is false)."""

    backend = "lmdb"
    durable = True

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = DEFAULT_MAP_SIZE, create: bool = True,
                 mac_key: bytes | None = None) -> None:
        self._env = LMDBEnvironment(path, map_size=map_size, create=create)
        try:
            self._db = self._env.db(CHUNKS_DB)
        except BaseException:
            self._env.close()
            raise
        super().__init__(mac_key=mac_key)

    @property
    def path(self) -> str:
        return self._env.path

    def __repr__(self) -> str:
        return f"LMDBStore({self._env.path!r})" if not self._closed else "LMDBStore(<closed>)"

    def _get_raw_many(self, keys: list[bytes]) -> list[RawBlob | None]:
        with self._env.read() as txn:
            # The memoryviews die with the transaction: copy each hit out once.
            return [None if (value := txn.get(key, db=self._db)) is None else bytearray(value) for key in keys]

    def _put_raw_many(self, pairs: list[tuple[bytes, RawBlob]]) -> None:
        def put_all(txn) -> None:
            for key, blob in pairs:
                txn.put(key, blob, db=self._db)

        self._env.write(put_all)

    def _delete_raw(self, key: bytes) -> bool:
        return self._env.write(lambda txn: txn.delete(key, db=self._db))

    def _contains_raw(self, key: bytes) -> bool:
        with self._env.read() as txn:
            return txn.get(key, db=self._db) is not None

    def _size_raw(self, key: bytes) -> int | None:
        with self._env.read() as txn:
            value = txn.get(key, db=self._db)
            return None if value is None else len(value)

    def _usage(self) -> Usage:
        with self._env.read() as txn:
            stat = txn.stat(self._db)
        pages = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return Usage(entries=stat["entries"], bytes=pages * stat["psize"])

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
        self._env.close()
