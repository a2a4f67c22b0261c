"""An in-process LRU over an ordered list of stores (typically LMDB, then Redis).

Reads go top-down and stop at the first tier that has a verified blob; that
blob is then copied into every tier above it (read-through), and the decoded
tensors into the LRU, so the next lookup is served closer to the GPU.  A
corrupt copy in one tier is dropped there and the lookup falls through to the
next tier, whose good copy then repairs it.  Writes go to every tier
(write-through), each absorbing its own transient failures, so losing Redis
leaves the LMDB tier answering. A write counts as taken only when a durable tier
(LMDB) took it, or, with no durable tier, every tier did: a cache tier that is down is
skipped, never the only copy.

The LRU caches decoded tensors: LRU hits cost no I/O, copy or checksum, and
every caller gets the same tensor objects, which must not be modified.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from ragkv.store.base import ChunkStore, Loaded, RawBlob, StoreUsage
from ragkv.store.errors import StoreUnavailableError
from ragkv.store.keys import ChunkKey
from ragkv.store.lru import ByteLRU
from ragkv.store.stats import StoreStats
from ragkv.store.tenant_budgets import TenantBudgets
from ragkv.store.tenant_stats import merged_evictions

DEFAULT_LRU_BYTES = 256 << 20


class TieredStore(ChunkStore):
    """LRU of ``lru_bytes`` (0 disables it) over ``tiers``, fastest first.

    The tiered store owns its tiers: closing it closes them.  Its
    ``entries``/``bytes`` are those of the first tier; every tier's own
    figures are in ``stats().tiers``.
    """

    backend = "tiered"
    _transient_errors = (StoreUnavailableError,)

    def __init__(
        self, tiers: Sequence[ChunkStore], *, lru_bytes: int = DEFAULT_LRU_BYTES, mac_key: bytes | None = None
    ) -> None:
        tiers = tuple(tiers)
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        for tier in tiers:
            if not isinstance(tier, ChunkStore):
                raise TypeError(f"tiers must be ChunkStore instances, not {type(tier).__name__}")
        if len({id(tier) for tier in tiers}) != len(tiers):
            raise ValueError("the same store appears twice in tiers")
        self._tiers = tiers
        self._lru: ByteLRU[bytes, Loaded] = ByteLRU(lru_bytes)
        super().__init__(mac_key=mac_key)

    @property
    def tiers(self) -> tuple[ChunkStore, ...]:
        return self._tiers

    def __repr__(self) -> str:
        return f"TieredStore({list(self._tiers)!r}, lru_bytes={self._lru.stats().capacity_bytes})"

    def stats(self) -> StoreStats:
        own = super().stats()
        tiers = tuple(tier.stats() for tier in self._tiers)
        return dataclasses.replace(
            own,
            corrupt=own.corrupt + sum(t.corrupt for t in tiers),
            errors=own.errors + sum(t.errors for t in tiers),
            evictions=sum(t.evictions for t in tiers),
            capacity_bytes=tiers[0].capacity_bytes,
            protected_bytes=tiers[0].protected_bytes,
            lru=self._lru.stats(),
            tiers=tiers,
            tenants=merged_evictions(own.tenants, (tier.tenants for tier in tiers)),
        )

    @property
    def keeps_tenant_budgets(self) -> bool:  # type: ignore[override]
        return any(tier.keeps_tenant_budgets for tier in self._tiers)

    def set_tenant_budgets(self, budgets: TenantBudgets) -> None:
        """The budgets of the tiers that keep them (LMDB); the others keep counting only."""
        if not self.keeps_tenant_budgets:
            super().set_tenant_budgets(budgets)
        for tier in self._tiers:
            if tier.keeps_tenant_budgets:
                tier.set_tenant_budgets(budgets)

    def tenant_bytes(self) -> dict[str, int] | None:
        """The first tier's counts (the one whose capacity bounds the store)."""
        return self._tiers[0].tenant_bytes()

    def recount(self) -> dict[str, int] | None:
        counts = [tier.recount() for tier in self._tiers]
        return counts[0]

    def _load(self, keys: list[ChunkKey]) -> list[Loaded | None]:
        found: list[Loaded | None] = [self._lru.get(key.to_bytes()) for key in keys]
        served = [key.to_bytes() for key, item in zip(keys, found) if item is not None]
        if served:  # the tiers below order their eviction by use: tell them of these reads
            for tier in self._tiers:
                tier._attempt("note use", tier._note_used, served, fallback=None)
        pending = [i for i, item in enumerate(found) if item is None]
        for depth, tier in enumerate(self._tiers):
            if not pending:
                break
            promote = []
            for i, item in zip(pending, tier._lookup([keys[i] for i in pending])):
                if item is not None:
                    found[i] = item
                    promote.append((keys[i].to_bytes(), item.blob))
                    self._lru.put(keys[i].to_bytes(), item, item.nbytes)
            if promote:
                for upper in self._tiers[:depth]:
                    upper._store_raw(promote)
            pending = [i for i in pending if found[i] is None]
        return found

    @property
    def durable(self) -> bool:  # type: ignore[override]
        return any(tier.durable for tier in self._tiers)

    def _put_raw_many(self, pairs: list[tuple[bytes, RawBlob]]) -> None:
        for key, _ in pairs:
            self._lru.discard(key)
        taken = [tier._store_raw(pairs) for tier in self._tiers]
        durable = [ok for tier, ok in zip(self._tiers, taken) if tier.durable]
        if not (any(durable) if durable else all(taken)):
            failed = ", ".join(tier.backend for tier, ok in zip(self._tiers, taken) if not ok)
            raise StoreUnavailableError(f"no durable tier took the write ({failed} failed)")

    def _delete_raw(self, key: bytes) -> bool:
        self._lru.discard(key)
        return any([tier._delete_key(key) for tier in self._tiers])  # list: delete everywhere

    def _contains_raw(self, key: bytes) -> bool:
        return key in self._lru or any(tier._contains_key(key) for tier in self._tiers)

    def _size_raw(self, key: bytes) -> int | None:
        """Bytes over all tiers (what deleting the key frees)."""
        sizes = [size for tier in self._tiers if (size := tier._attempt("size", tier._size_raw, key, fallback=None))]
        return sum(sizes) if sizes else None

    def _usage(self) -> StoreUsage:
        primary = self._tiers[0].stats()
        return StoreUsage(entries=primary.entries, bytes=primary.bytes)

    def _iter_raw_keys(self, prefix: bytes) -> Iterator[bytes]:
        seen: set[bytes] = set()
        for tier in self._tiers:
            for key in tier.iter_keys(prefix):
                raw = key.to_bytes()
                if raw not in seen:
                    seen.add(raw)
                    yield raw

    def _close(self) -> None:
        self._lru.clear()
        for tier in self._tiers:
            tier.close()
