"""Wiring: one object that opens the store, the registry, the engine and the embedder
from a typed config. The CLI, the benchmarks and the API all start from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ragkv.ingest.embedder import Embedder
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.ingest.registry_url import registry_url_from_env
from ragkv.engine import Engine, EngineConfig
from ragkv.app.rag import RagPipeline
from ragkv.app.codebooks import attach_codebook
from ragkv.app.storage import Storage, StorageConfig, default_data_dir


@dataclass(frozen=True)
class RuntimeConfig:
    data_dir: Path = field(default_factory=default_data_dir)
    """Folder of the embedded LMDB environment (chunks, documents, embeddings)."""
    store_url: str | None = None
    """Chunk store URL; None = lmdb://<data_dir>/db, sharing the registry's environment.
    Also redis://HOST:PORT/DB or a tiered URL (see store.url)."""
    registry_url: str | None = field(default_factory=registry_url_from_env)
    """Document registry URL ($RAGKV_REGISTRY); None = the data folder's LMDB. redis://HOST:PORT/DB
    shares documents between replicas on several hosts (see ingest.registry_url)."""
    store_secret: str | None = field(default=None, repr=False)
    """Deployment secret for blob MACs (see StorageConfig)."""
    store_capacity: int | None = None
    """Bytes of chunk KV the LMDB store keeps; beyond it the least recently used chunks are
    evicted (and recomputed from their text when next retrieved). None = unbounded."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)

    def __post_init__(self) -> None:
        self.storage  # StorageConfig validates the storage fields (store_capacity)

    @property
    def lmdb_path(self) -> Path:
        return self.storage.lmdb_path

    @property
    def resolved_store_url(self) -> str:
        return self.storage.resolved_store_url

    @property
    def storage(self) -> StorageConfig:
        return StorageConfig(self.data_dir, self.store_url, self.registry_url, self.store_secret, self.store_capacity)


class Runtime:
    """Storage plus the model. `read_only=True` (commands that only answer) creates no
    folder or store: see Storage."""

    def __init__(self, config: RuntimeConfig = RuntimeConfig(), *, read_only: bool = False):
        self.config = config
        self.storage = Storage(config.storage, read_only=read_only)
        self.env, self.store, self.registry = self.storage.env, self.storage.store, self.storage.registry
        try:
            self._open_model(config)
        except BaseException:
            self.storage.close()
            raise

    def _open_model(self, config: RuntimeConfig) -> None:
        self.engine = Engine(config.engine)
        attach_codebook(self.engine, self.env)  # a calibrated A2ATS codebook makes ingestion store codes
        self.embedder = Embedder()
        self.ingestor = Ingestor(self.engine, self.store, self.registry, self.embedder, self.storage.journal,
                                 config.ingest)
        self.rag = RagPipeline(self.engine, self.store, self.registry, self.embedder)

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
