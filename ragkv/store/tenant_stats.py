"""Each tenant's figures in a store: bytes held (counted with every write, see
:mod:`store.tenant_bytes`), and lookups and evictions since the store opened."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantStats:
    """One tenant's figures (``tenant=""``: chunks shared across tenants). ``bytes`` is
    ``None`` where the store does not count them."""

    tenant: str
    bytes: int | None
    hits: int
    misses: int
    evictions: int

    def __post_init__(self) -> None:
        for name in ("bytes", "hits", "misses", "evictions"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"TenantStats.{name} must be a non-negative int; got {value!r}")

    def to_dict(self) -> dict[str, int | None]:
        return {"bytes": self.bytes, "hits": self.hits, "misses": self.misses, "evictions": self.evictions}


class TenantCounters:
    """Lookups and evictions per tenant; the store calls it under its counter lock."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}  # tenant -> [hits, misses, evictions]

    def looked_up(self, tenants: Sequence[str], found: Sequence[bool]) -> None:
        for tenant, hit in zip(tenants, found):
            self._of(tenant)[0 if hit else 1] += 1

    def evicted(self, counts: Mapping[str, int]) -> None:
        for tenant, count in counts.items():
            self._of(tenant)[2] += count

    def snapshot(self, held: Mapping[str, int] | None) -> tuple[TenantStats, ...]:
        """Every tenant seen or holding bytes, by name; `held`: bytes per tenant (None: not counted)."""
        names = sorted(set(self._counts) | set(held or {}))
        return tuple(
            TenantStats(name, None if held is None else held.get(name, 0), *self._counts.get(name, (0, 0, 0)))
            for name in names
        )

    def _of(self, tenant: str) -> list[int]:
        counts = self._counts.get(tenant)
        if counts is None:
            counts = self._counts[tenant] = [0, 0, 0]
        return counts


def merged_evictions(own: Iterable[TenantStats], tiers: Iterable[Iterable[TenantStats]]) -> tuple[TenantStats, ...]:
    """`own` (a composite store's lookups and bytes) with each tenant's evictions summed over
    its tiers (only a tier evicts)."""
    evictions: dict[str, int] = {}
    for tier in tiers:
        for stats in tier:
            evictions[stats.tenant] = evictions.get(stats.tenant, 0) + stats.evictions
    by_name = {stats.tenant: stats for stats in own}
    for name in evictions.keys() - by_name.keys():
        by_name[name] = TenantStats(name, None, 0, 0, 0)
    return tuple(
        TenantStats(s.tenant, s.bytes, s.hits, s.misses, evictions.get(s.tenant, 0))
        for s in sorted(by_name.values(), key=lambda s: s.tenant)
    )
