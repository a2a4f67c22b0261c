"""Where a deployment keeps its data: the settings only, importable without the stores
(a command builds its options from them before anything is opened)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ragkv.ingest.registry_url import registry_url_from_env


def default_data_dir() -> Path:
    """$RAGKV_HOME, else ~/.ragkv: the LMDB environment and job state live here."""
    return Path(os.environ.get("RAGKV_HOME", Path.home() / ".ragkv"))


@dataclass(frozen=True)
class StorageConfig:
    data_dir: Path = field(default_factory=default_data_dir)
    """Folder of the embedded LMDB environment (chunks, documents, embeddings)."""
    store_url: str | None = None
    """Chunk store URL; None = lmdb://<data_dir>/db, sharing the registry's environment.
    Also redis://HOST:PORT/DB or a tiered URL (see store.url)."""
    registry_url: str | None = field(default_factory=registry_url_from_env)
    """Document registry URL ($RAGKV_REGISTRY); None = the data folder's LMDB. redis://HOST:PORT/DB
    shares documents between replicas on several hosts (see ingest.registry_url)."""
    store_secret: str | None = field(default=None, repr=False)
    """Deployment secret: chunk blobs carry a MAC keyed by it instead of a CRC-32, so a
    party that can write to a shared store cannot plant KV (store.blob). None = CRC-32."""
    store_capacity: int | None = None
    """Bytes of chunk KV the LMDB store keeps; beyond it chunks are evicted (and recomputed
    from their text when next retrieved), those never read since written first (segmented
    LRU). None = unbounded."""
    store_protected_share: float | None = None
    """With a capacity: the share of it kept for chunks read again since they were written,
    evicted last (0: plain LRU). None = the store's default, 0.65 (store.recency)."""
    store_tenant_budget: int | None = None
    """Bytes of chunk KV each tenant may keep in the store (LMDB, or one Redis server): past
    it the tenant's own least recently used chunks are evicted, never another's (a key's
    store_budget_bytes in the API keys file sets its tenant's own). None = no budget; a full store still evicts
    from the tenant most above its fair share of --store-capacity."""
    store_tenant_budgets: tuple[tuple[str, int], ...] = ()
    """(tenant, bytes): tenants' own budgets, replacing store_tenant_budget (from the API
    keys file)."""

    def __post_init__(self) -> None:
        if self.store_capacity is not None and self.store_capacity < 1:
            raise ValueError(f"store_capacity must be a positive number of bytes, got {self.store_capacity}")
        _check_budgets(self)
        share = self.store_protected_share
        if share is not None and not 0 <= share < 1:
            raise ValueError(f"store_protected_share must be in [0, 1) (0: plain LRU), got {share}")

    @property
    def has_tenant_budgets(self) -> bool:
        return self.store_tenant_budget is not None or bool(self.store_tenant_budgets)

    @property
    def lmdb_path(self) -> Path:
        return Path(self.data_dir) / "db"

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or f"lmdb://{self.lmdb_path.resolve()}"


_CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def _positive_bytes(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _check_budgets(config: StorageConfig) -> None:
    if config.store_tenant_budget is not None and not _positive_bytes(config.store_tenant_budget):
        raise ValueError(f"store_tenant_budget must be a positive number of bytes, got {config.store_tenant_budget}")
    for tenant, budget in config.store_tenant_budgets:
        if not _positive_bytes(budget):
            raise ValueError(f"the store budget of tenant {tenant!r} must be a positive number of bytes, got {budget}")
    if config.has_tenant_budgets and (config.store_url or "").startswith(_CLUSTER_SCHEMES):
        raise ValueError(
            "per-tenant store budgets are kept by an LMDB store or a single Redis server; "
            "a Redis Cluster chunk store only counts each tenant's bytes"
        )
