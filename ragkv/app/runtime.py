"""Wiring: one object that opens the store, the registry, the engine and the embedder
from a typed config. The CLI, the benchmarks and the API all start from here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ragkv.ingest.embedder import Embedder
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.ingest.registry import Registry
from ragkv.engine import Engine, EngineConfig
from ragkv.app.rag import RagPipeline
from ragkv.app.codebooks import attach_codebook
from ragkv.store.base import ChunkStore
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.url import open_store


def default_data_dir() -> Path:
    """$RAGKV_HOME, else ~/.ragkv: the LMDB environment and job state live here."""
    return Path(os.environ.get("RAGKV_HOME", Path.home() / ".ragkv"))


@dataclass(frozen=True)
class RuntimeConfig:
    data_dir: Path = field(default_factory=default_data_dir)
    """Folder of the embedded LMDB environment (chunks, documents, embeddings)."""
    store_url: str | None = None
    """Chunk store URL; None = lmdb://<data_dir>/db, sharing the registry's environment.
    Also redis://HOST:PORT/DB or a tiered URL (see store.url)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)

    @property
    def lmdb_path(self) -> Path:
        return Path(self.data_dir) / "db"

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or f"lmdb://{self.lmdb_path.resolve()}"


class Runtime:
    def __init__(self, config: RuntimeConfig = RuntimeConfig()):
        self.config = config
        Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        self.env = LMDBEnvironment(config.lmdb_path)
        self.store: ChunkStore = open_store(config.resolved_store_url)
        self.registry = Registry(self.env)
        self.engine = Engine(config.engine)
        attach_codebook(self.engine, self.env)  # a calibrated A2ATS codebook makes ingestion store codes
        self.embedder = Embedder()
        self.ingestor = Ingestor(self.engine, self.store, self.registry, self.embedder, config.ingest)
        self.rag = RagPipeline(self.engine, self.store, self.registry, self.embedder)

    def close(self) -> None:
        self.store.close()
        self.env.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
