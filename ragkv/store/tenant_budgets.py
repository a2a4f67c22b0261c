"""How many chunk bytes each tenant may keep, and whose chunks a full store evicts.

Two rules, applied in the write transaction that needs them (:mod:`store.lmdb_store`):

- **Budget.** A tenant with a budget (its own, else the default) that a write takes past
  it evicts its own least recently used chunks (the segmented-LRU order, restricted to its
  chunks) until it fits again; no other tenant loses anything to it. A budget is a ceiling,
  not a reservation: it keeps nothing for a tenant.
- **Fair share.** A store over its capacity takes its victims from the tenant holding the
  most bytes above its fair share, the capacity divided by the number of tenants holding
  any bytes. So while others are active no tenant keeps more than its share at their
  expense, and a lone tenant may use the whole capacity.

Shared chunks (tenant ``""``) count as a tenant of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ragkv.store.keys import check_tenant as check_tenant_name


def _check_budget(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive number of bytes or None; got {value!r}")


@dataclass(frozen=True)
class TenantBudgets:
    """Per-tenant byte budgets of a store: ``default`` for every tenant (None: no budget),
    ``tenants`` a tenant's own, which replaces the default."""

    default: int | None = None
    tenants: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_budget("the default tenant budget", self.default)
        if not isinstance(self.tenants, Mapping):
            raise TypeError(f"TenantBudgets.tenants must be a mapping of tenant -> bytes; got {self.tenants!r}")
        for tenant, budget in self.tenants.items():
            check_tenant_name(tenant)
            _check_budget(f"the budget of tenant {tenant!r}", budget)
        object.__setattr__(self, "tenants", MappingProxyType(dict(self.tenants)))

    @property
    def any(self) -> bool:
        """Whether any tenant has a budget."""
        return self.default is not None or bool(self.tenants)

    def of(self, tenant: str) -> int | None:
        """The tenant's budget in bytes (None: none)."""
        return self.tenants.get(tenant, self.default)


def fair_share_order(counts: Mapping[str, int]) -> list[str]:
    """Tenants to evict from, the one holding most above its fair share first; `counts`:
    bytes per tenant. Every holding tenant has the same share, so that is the order of
    bytes held (ties by name, the same order in every process)."""
    holding = {tenant: size for tenant, size in counts.items() if size > 0}
    return sorted(holding, key=lambda tenant: (-holding[tenant], tenant))
