"""Wiring: one object that opens the store, the registry, the engine and the embedder
from a typed config. The CLI, the benchmarks and the API all start from here."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

from ragkv.app.calibrated import Calibrated
from ragkv.app.codebooks import stored_codebook
from ragkv.app.fusion_calibration import stored_fusion_settings
from ragkv.app.passages import PromptPassages
from ragkv.app.rag import RagPipeline
from ragkv.app.status import DefaultFusion, StoreStatus, default_fusion, store_status
from ragkv.app.storage import Storage, StorageConfig
from ragkv.engine import Engine, EngineConfig
from ragkv.ingest.chunk_context import ChunkContextualizer, ContextResult
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.store.write_behind import WriteBehindStore


@dataclass(frozen=True)
class RuntimeConfig(StorageConfig):
    """The storage fields (StorageConfig: data folder, store, registry, secret, capacity),
    the engine's and ingestion's."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)


class Runtime:
    """Storage plus the model. `read_only=True` (commands that only answer) creates no
    folder or store: see Storage."""

    def __init__(self, config: RuntimeConfig = RuntimeConfig(), *, read_only: bool = False):
        self.config = config
        self.storage = Storage(config, read_only=read_only)
        self.env, self.store, self.registry = self.storage.env, self.storage.store, self.storage.registry
        try:
            self._open_model(config)
        except BaseException:
            self.storage.close()
            raise

    def _open_model(self, config: RuntimeConfig) -> None:
        self.engine = Engine(config.engine)
        self.calibrated = Calibrated(
            stored_codebook(self.engine, self.env), stored_fusion_settings(self.env, self.engine.fingerprint)
        )
        """What `ragkv calibrate` stored for this model: a codebook makes every stored chunk
        carry its A2ATS codes; fusion settings serve requests that name no ratio."""
        self.embedder = Embedder()
        self.ingestor = Ingestor(
            self.engine,
            self.store,
            self.registry,
            self.embedder,
            self.storage.journal,
            config.ingest,
            codebook=self.calibrated.codebook,
        )
        shared = config.ingest.share_chunks_across_tenants
        self.fills = WriteBehindStore(self.store)
        """The store as queries and pasted passages see it: what they compute for it (a
        chunk the store lacked, a new passage) is written behind, off the model thread."""
        self.rag = RagPipeline(
            self.engine,
            self.fills,
            self.registry,
            self.embedder,
            share_across_tenants=shared,
            calibrated=self.calibrated,
        )
        self.passages = PromptPassages(self.engine, self.fills, share_across_tenants=shared, calibrated=self.calibrated)
        """Passages pasted into prompts, found and reused from the store (chat, completions)."""
        neighbours = config.ingest.context_neighbours
        self.contextualizer = (
            ChunkContextualizer(
                self.engine, self.store, self.registry, neighbours, shared, codebook=self.calibrated.codebook
            )
            if neighbours
            else None
        )
        """Recomputes new documents' chunk K/V in context (IngestConfig.context_neighbours)."""

    def contextualize(self, tenant: str, doc_ids: list[str]) -> ContextResult | None:
        """After ingesting `doc_ids`: their chunks' stored K/V recomputed in context, when
        the ingestion config asks for it (None when it does not)."""
        if self.contextualizer is None or not doc_ids:
            return None
        return self.contextualizer.contextualize(tenant, doc_ids)

    def contextualize_steps(self, tenant: str, doc_ids: list[str]) -> Generator[int, None, ContextResult | None]:
        """`contextualize` one chunk per step (the model worker's ingestion task)."""
        if self.contextualizer is None or not doc_ids:
            return None
        return (yield from self.contextualizer.contextualize_steps(tenant, doc_ids))

    def store_status(self) -> StoreStatus:
        """The chunk store's health; pings Redis (blocking: call from a thread)."""
        return store_status(self.store)

    def default_fusion(self) -> DefaultFusion:
        return default_fusion(self.calibrated.fusion)

    def close(self) -> None:
        fills = getattr(self, "fills", None)  # absent when the model failed to open
        if fills is not None:
            fills.close()  # the queued writes reach the store before it closes
        self.storage.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
