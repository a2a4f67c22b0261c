"""Each tenant's chunk bytes in an LMDB store, counted in the transaction that writes them.

The ``chunk_tenants`` sub-database maps ``t/`` + tenant (the tenant a key names, see
:func:`store.keys.tenant_of`; ``""`` for shared chunks) to the blob bytes its chunks hold.
Every put, delete and eviction adjusts it in the same write transaction as the chunk, so
the counts can never disagree with the chunks, not even after a crash: LMDB commits both
or neither. ``counted`` marks an environment whose counts are kept; one without it (written
before counts existed) is recounted by a full scan when the store opens.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from ragkv.store.keys import tenant_of

TENANTS_DB = "chunk_tenants"
_PREFIX = b"t/"
_COUNTED = b"counted"
_COUNT = struct.Struct(">q")


class TenantBytes:
    """Reads and adjusts the counts inside a caller's transaction."""

    def __init__(self, tenants_db: object) -> None:
        self._db = tenants_db

    def add(self, txn, tenant: str, delta: int) -> None:
        if not delta:
            return
        key = _PREFIX + tenant.encode("ascii")
        total = self._get(txn, key) + delta
        if total > 0:
            txn.put(key, _COUNT.pack(total), db=self._db)
        else:
            txn.delete(key, db=self._db)

    def changed(self, txn, key: bytes, old_size: int, new_size: int) -> None:
        """The chunk under `key` went from `old_size` bytes to `new_size` (0: absent)."""
        self.add(txn, tenant_of(key), new_size - old_size)

    def of(self, txn, tenant: str) -> int:
        return self._get(txn, _PREFIX + tenant.encode("ascii"))

    def all(self, txn) -> dict[str, int]:
        """Bytes per tenant with any (``""``: chunks no tenant owns)."""
        cursor = txn.cursor(db=self._db)
        found: dict[str, int] = {}
        if cursor.set_range(_PREFIX):
            for key, value in cursor.iternext():
                key = bytes(key)
                if not key.startswith(_PREFIX):
                    break
                found[key[len(_PREFIX) :].decode("ascii")] = _COUNT.unpack(bytes(value))[0]
        return found

    def recount(self, txn, chunks: Iterable[tuple[bytes, int]]) -> dict[str, int]:
        """Replace the counts by those of `chunks` ((key, blob size) of every chunk: a full
        scan); returns them."""
        counts: dict[str, int] = {}
        for key, size in chunks:
            tenant = tenant_of(key)
            counts[tenant] = counts.get(tenant, 0) + size
        for tenant in self.all(txn):
            txn.delete(_PREFIX + tenant.encode("ascii"), db=self._db)
        for tenant, total in counts.items():
            if total:
                txn.put(_PREFIX + tenant.encode("ascii"), _COUNT.pack(total), db=self._db)
        txn.put(_COUNTED, b"1", db=self._db)
        return counts

    def kept(self, txn) -> bool:
        """Whether the counts are kept here (else they need a recount)."""
        return txn.get(_COUNTED, db=self._db) is not None

    def _get(self, txn, key: bytes) -> int:
        raw = txn.get(key, db=self._db)
        return 0 if raw is None else _COUNT.unpack(bytes(raw))[0]


def scan_sizes(txn, chunks_db: object) -> Iterable[tuple[bytes, int]]:
    """(key, blob size) of every chunk in `chunks_db`: the full scan a recount reads."""
    for key, value in txn.cursor(db=chunks_db).iternext():
        yield bytes(key), len(value)
