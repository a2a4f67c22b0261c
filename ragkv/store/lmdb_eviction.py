"""Which chunks an LMDB store deletes in a write transaction, and the deletion itself.

After a write, first each tenant the write took over its budget evicts its own least
recently used chunks until it fits (:class:`store.tenant_budgets.TenantBudgets`); then, while
the chunks exceed the store's capacity, the tenant holding the most bytes above its fair
share gives up its least recently used chunk. Each tenant's order is the store's
segmented-LRU order restricted to its chunks (:meth:`RecencyIndex.pop_oldest_of`), so a
victim costs one cursor seek, never a scan of the store. Kept chunks (this write's, and the
ones this process read last) are skipped.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from ragkv.store.keys import tenant_of
from ragkv.store.recency import RecencyIndex
from ragkv.store.tenant_budgets import TenantBudgets, fair_share_order
from ragkv.store.tenant_bytes import TenantBytes

logger = logging.getLogger("ragkv.store")


def pages_bytes(txn, chunks_db: object) -> int:
    """Bytes of the pages the chunks take (what the capacity bounds)."""
    stat = txn.stat(chunks_db)
    return (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]


class ChunkEviction:
    """Deletes chunks inside a caller's write transaction, counting their tenants' bytes."""

    def __init__(
        self,
        chunks_db: object,
        recency: RecencyIndex,
        tenants: TenantBytes,
        capacity: int | None,
        budgets: TenantBudgets = TenantBudgets(),
    ) -> None:
        self._db = chunks_db
        self._recency = recency
        self._tenants = tenants
        self._capacity = capacity
        self.budgets = budgets

    @property
    def bounded(self) -> bool:
        """Whether anything (a capacity, a budget) ever evicts."""
        return self._capacity is not None or self.budgets.any

    def delete(self, txn, key: bytes) -> bool:
        old = txn.get(key, db=self._db)
        if old is None:
            return False
        self._tenants.changed(txn, key, len(old), 0)
        return txn.delete(key, db=self._db)

    def evict(self, txn, written: Iterable[bytes], keep: frozenset[bytes]) -> Counter[str]:
        """Evict what the budgets and the capacity call for after a write of `written`,
        sparing `keep`; chunks evicted per tenant."""
        evicted: Counter[str] = Counter()
        if self.budgets.any:
            for tenant in sorted({tenant_of(key) for key in written}):
                self._fit_budget(txn, tenant, keep, evicted)
        if self._capacity is not None:
            self._fit_capacity(txn, keep, evicted)
        return evicted

    def _fit_budget(self, txn, tenant: str, keep: frozenset[bytes], evicted: Counter[str]) -> None:
        budget = self.budgets.of(tenant)
        if budget is None or self._tenants.of(txn, tenant) <= budget:
            return
        for key in self._recency.pop_oldest_of(txn, tenant, keep):
            evicted[tenant] += self.delete(txn, key)
            if self._tenants.of(txn, tenant) <= budget:
                return

    def _fit_capacity(self, txn, keep: frozenset[bytes], evicted: Counter[str]) -> None:
        spent: set[str] = set()  # tenants with nothing left to evict
        capacity = self._capacity
        while pages_bytes(txn, self._db) > capacity:
            counts = self._tenants.all(txn)
            order = [tenant for tenant in fair_share_order(counts) if tenant not in spent]
            if not order:
                logger.warning("LMDB store holds more than its capacity of %d bytes: the rest is in use", capacity)
                return
            tenant, runner_up = order[0], order[1] if len(order) > 1 else None
            spent.add(tenant)  # unless it gives up a chunk below
            # One cursor walk while the tenant stays first (the runner-up's bytes do not change meanwhile).
            for key in self._recency.pop_oldest_of(txn, tenant, keep):
                spent.discard(tenant)
                evicted[tenant] += self.delete(txn, key)
                if pages_bytes(txn, self._db) <= capacity:
                    return
                if runner_up is not None and fair_share_order(
                    {tenant: self._tenants.of(txn, tenant), runner_up: counts[runner_up]}
                ) != [tenant, runner_up]:
                    break
