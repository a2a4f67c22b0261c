"""The data side of a deployment without the model: the LMDB environment, the document
registry and the chunk store. Commands that never run the model (`docs`, `store gc`)
open only this; the Runtime opens it under the engine."""

from __future__ import annotations

from pathlib import Path

from ragkv.app.storage_config import StorageConfig
from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.registry import DocumentRegistry
from ragkv.ingest.registry_url import open_registry
from ragkv.ingest.store_binding import check_store
from ragkv.store.base import ChunkStore
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.tenant_budgets import TenantBudgets
from ragkv.store.url import open_store


class Storage:
    """Opens what `config` names. `read_only=True` writes nothing; `create=False` (implied
    by read_only) opens only what exists: a missing data folder or store is a
    FileNotFoundError and nothing is created. Opened for writing, it first settles what
    interrupted ingestions left (the journal)."""

    def __init__(self, config: StorageConfig, *, read_only: bool = False, create: bool | None = None):
        self.config = config
        create = not read_only if create is None else create and not read_only
        if not create and not Path(config.lmdb_path, "data.mdb").is_file():
            raise FileNotFoundError(
                f"no ragkv data at {config.lmdb_path} (nothing was created): "
                "ingest some documents first or pass --data-dir"
            )
        if create:
            Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        self.env = LMDBEnvironment(config.lmdb_path, create=create)
        try:
            capacity = {} if config.store_capacity is None else {"capacity": config.store_capacity}
            if config.store_protected_share is not None:
                capacity["protected"] = config.store_protected_share
            self.store: ChunkStore = open_store(
                config.resolved_store_url, create=create, secret=config.store_secret, **capacity
            )
        except BaseException:
            self.env.close()
            raise
        if config.has_tenant_budgets:
            try:
                budgets = TenantBudgets(config.store_tenant_budget, dict(config.store_tenant_budgets))
                self.store.set_tenant_budgets(budgets)
            except BaseException:
                self.store.close()
                self.env.close()
                raise
        try:
            # The retrieval index is a cache derived from the registry: written even when read_only.
            self.registry: DocumentRegistry = open_registry(
                config.registry_url, self.env, Path(config.data_dir) / "index"
            )
        except BaseException:
            self.store.close()
            self.env.close()
            raise
        self.journal = IngestJournal(self.env)
        self.previous_store = check_store(self.env, config.resolved_store_url, record=not read_only)
        """The chunk store this data folder's registry was used with before, when another."""
        if not read_only:
            # Blobs of ingestions a dead process left half done are deleted before anything runs.
            self.journal.reconcile(self.registry.refcount, self.store)

    def close(self) -> None:
        self.registry.close()
        self.store.close()
        self.env.close()

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
