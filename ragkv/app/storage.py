"""The data side of a deployment without the model: the LMDB environment, the document
registry and the chunk store. Commands that never run the model (`docs`, `store gc`)
open only this; the Runtime opens it under the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ragkv.ingest.registry import Registry
from ragkv.ingest.registry_url import open_registry, registry_url_from_env
from ragkv.store.base import ChunkStore
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.url import open_store


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

    @property
    def lmdb_path(self) -> Path:
        return Path(self.data_dir) / "db"

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or f"lmdb://{self.lmdb_path.resolve()}"


class Storage:
    """Opens what `config` names. `read_only=True` opens only what exists and creates
    nothing: a missing data folder or store is a FileNotFoundError."""

    def __init__(self, config: StorageConfig, *, read_only: bool = False):
        self.config = config
        if read_only and not Path(config.lmdb_path, "data.mdb").is_file():
            raise FileNotFoundError(
                f"no ragkv data at {config.lmdb_path} (nothing was created): ingest some documents first or pass --data-dir")
        if not read_only:
            Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        self.env = LMDBEnvironment(config.lmdb_path, create=not read_only)
        try:
            self.store: ChunkStore = open_store(config.resolved_store_url, create=not read_only)
        except BaseException:
            self.env.close()
            raise
        try:
            self.registry: Registry = open_registry(config.registry_url, self.env)
        except BaseException:
            self.store.close()
            self.env.close()
            raise

    def close(self) -> None:
        self.registry.close()
        self.store.close()
        self.env.close()

    def __enter__(self) -> "Storage":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
