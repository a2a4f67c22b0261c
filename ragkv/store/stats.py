"""Counters a store reports, as typed snapshots that serialize to plain dicts."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ragkv.store.tenant_stats import TenantStats


def _check_counts(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{type(obj).__name__}.{name} must be a non-negative int; got {value!r}")


@dataclass(frozen=True)
class LRUStats:
    """Snapshot of an in-process LRU (see :class:`store.lru.ByteLRU`)."""

    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int

    def __post_init__(self) -> None:
        _check_counts(self, tuple(f.name for f in fields(self)))

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_STORE_COUNTS = (
    "entries",
    "bytes",
    "hits",
    "misses",
    "corrupt",
    "errors",
    "evictions",
    "capacity_bytes",
    "protected_bytes",
)


@dataclass(frozen=True)
class StoreStats:
    """Snapshot of a store's counters since it was opened.

    ``hits``/``misses`` count keys looked up; a corrupt blob counts as a miss
    *and* in ``corrupt``.  ``errors`` counts backend operations that failed
    and were absorbed (a dead Redis).  ``entries``/``bytes`` describe what the
    backend holds right now, or are ``None`` when it cannot be asked.
    ``evictions`` counts chunks deleted to stay within ``capacity_bytes``
    (``None``: the store is unbounded); each one costs a recompute on its next use.
    ``protected_bytes``: of a capped LMDB store, the chunks read since written (evicted last).
    ``tenants``: each tenant's bytes, lookups and evictions, by tenant name.
    """

    backend: str
    entries: int | None
    bytes: int | None
    hits: int
    misses: int
    corrupt: int
    errors: int
    evictions: int = 0
    capacity_bytes: int | None = None
    protected_bytes: int | None = None
    lru: LRUStats | None = None
    tiers: tuple[StoreStats, ...] = ()
    tenants: tuple[TenantStats, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"StoreStats.backend must be a non-empty str; got {self.backend!r}")
        _check_counts(self, _STORE_COUNTS)
        if self.lru is not None and not isinstance(self.lru, LRUStats):
            raise TypeError("StoreStats.lru must be an LRUStats or None")
        if not isinstance(self.tiers, tuple) or not all(isinstance(t, StoreStats) for t in self.tiers):
            raise TypeError("StoreStats.tiers must be a tuple of StoreStats")
        if not isinstance(self.tenants, tuple) or not all(isinstance(t, TenantStats) for t in self.tenants):
            raise TypeError("StoreStats.tenants must be a tuple of TenantStats")

    def tenant(self, name: str) -> TenantStats | None:
        """The figures of tenant `name` (None: none seen)."""
        return next((t for t in self.tenants if t.tenant == name), None)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form; ``lru``/``tiers`` appear only for composite stores, ``tenants``
        only once a tenant was seen."""
        out: dict[str, object] = {name: getattr(self, name) for name in ("backend", *_STORE_COUNTS)}
        if self.lru is not None:
            out["lru"] = self.lru.to_dict()
        if self.tiers:
            out["tiers"] = [tier.to_dict() for tier in self.tiers]
        if self.tenants:
            out["tenants"] = {t.tenant: t.to_dict() for t in self.tenants}
        return out
