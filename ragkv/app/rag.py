"""The query path: retrieve chunks, load their KV, fuse with the question, decode.

This module wires the engine to the store and the registry (it is not part of the
engine proper, which knows neither).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

from ragkv.app.calibrated import Calibrated
from ragkv.app.limits import check_context_length
from ragkv.engine import Engine
from ragkv.engine.generation import GenerationConfig
from ragkv.errors import InputError
from ragkv.fusion import FusionConfig, FusionInput, FusionResult, LoadedChunk
from ragkv.fusion.layout import Layout
from ragkv.ingest.chunk_keys import ChunkKeys
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.index.filters import MetadataFilter
from ragkv.ingest.index.hybrid import DEFAULT_RETRIEVAL, check_mode
from ragkv.ingest.registry import ChunkRecord, DocumentRecord, DocumentRegistry, check_tenant
from ragkv.sparse import SparseConfig
from ragkv.sparse.wiring import sparse_chunk_codes
from ragkv.store.base import ChunkStore
from ragkv.store.keys import ChunkKey

log = logging.getLogger("ragkv.app.rag")


@dataclass(frozen=True)
class QueryConfig:
    top_k: int = 5
    """Chunks retrieved for the question."""
    doc_ids: tuple[str, ...] | None = None
    """Restrict retrieval to these documents (all of their chunks when top_k allows)."""
    retrieval: str = DEFAULT_RETRIEVAL
    """dense (embeddings), bm25 (words) or hybrid (both, fused by reciprocal rank)."""
    filter: MetadataFilter | None = None
    """Retrieve only from documents whose metadata matches (applied inside the search)."""
    fusion: FusionConfig = field(default_factory=FusionConfig)
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=128))
    sparse: SparseConfig | None = None
    """Sparse decode (selector, budget, SnapKV eviction); None = dense decode."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= 64:
            raise ValueError(f"top_k must be in [1, 64], got {self.top_k}")
        if self.doc_ids is not None and not self.doc_ids:
            raise ValueError("doc_ids, when given, must name at least one document")
        check_mode(self.retrieval)


@dataclass(frozen=True)
class Citation:
    doc_id: str
    name: str
    chunk_index: int
    char_start: int
    char_end: int
    score: float
    text: str
    page: int | None = None
    """1-based page where the chunk starts, for documents with pages (PDF)."""
    page_end: int | None = None
    """1-based page where the chunk ends (a chunk may span pages: `page`..`page_end`)."""


@dataclass
class PreparedQuery:
    """A fused cache ready to decode, plus what the answer reports."""

    fusion: FusionResult
    citations: list[Citation]
    timings: dict[str, float]
    """Seconds: retrieve, load, fuse."""
    strategy: str
    chunk_hashes: list[str] = field(default_factory=list)
    """Token hashes of the fused chunks, in prompt order."""
    chunk_codes: list | None = None
    """Per chunk, its A2ATS codes under the engine's codebook (sparse a2ats only)."""
    recomputed_chunks: tuple[int, ...] = ()
    """Indices (in fusion order) of chunks whose KV was computed for this request because
    the store had none to give (a miss, a corrupt blob, another model's store)."""


@dataclass
class QueryInputs:
    """What a question reads before the model: its retrieved chunks (least relevant first),
    their stored tensors (None where the store has none), their citations."""

    question: str
    tenant: str
    retrieved: list[tuple[DocumentRecord, ChunkRecord, float]]
    entries: list
    citations: list[Citation]
    retrieve_s: float = 0.0
    load_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.entries)


def tensor_bytes(entries) -> int:
    """Bytes of the tensors in `entries` (mappings of tensors, or None)."""
    return sum(t.numel() * t.element_size() for e in entries if e is not None for t in e.values())


class RagPipeline:
    def __init__(
        self,
        engine: Engine,
        store: ChunkStore,
        registry: DocumentRegistry,
        embedder: Embedder,
        *,
        share_across_tenants: bool = False,
        calibrated: Calibrated | None = None,
    ):
        self.engine = engine
        self.store = store
        self.registry = registry
        self.embedder = embedder
        self.share_across_tenants = share_across_tenants
        self.calibrated = calibrated or Calibrated()

    @functools.cached_property
    def keys(self) -> ChunkKeys:
        # Lazy: a retrieval-only pipeline (no engine) never makes a key.
        return ChunkKeys.of(self.engine, self.share_across_tenants)

    def chunk_key(self, tenant: str, chunk_hash: str) -> ChunkKey:
        return self.keys.key(tenant, chunk_hash)

    def retrieve(
        self,
        question: str,
        tenant: str,
        top_k: int,
        doc_ids: tuple[str, ...] | None,
        retrieval: str = DEFAULT_RETRIEVAL,
        metadata_filter: MetadataFilter | None = None,
    ) -> list[tuple[DocumentRecord, ChunkRecord, float]]:
        """The top_k chunks for the question through the registry's retrieval index, least
        relevant first; only of `doc_ids` and of documents `metadata_filter` matches."""
        if doc_ids is not None:
            for doc_id in doc_ids:
                self.registry.get(tenant, doc_id)  # NotFoundError for unknown ids
        index = self.registry.index
        allowed = index.allowed(tenant, metadata_filter, set(doc_ids) if doc_ids else None)
        query_vector = self.embedder.embed_queries([question])[0] if retrieval != "bm25" else None
        hits = index.search(tenant, retrieval, query_vector, question, top_k, allowed)
        records: dict[str, DocumentRecord] = {}
        found = []
        for hit in hits:
            record = records.get(hit.doc_id) or records.setdefault(hit.doc_id, self.registry.get(tenant, hit.doc_id))
            found.append((record, record.chunks[hit.chunk_index], hit.score))
        # Most relevant last: nearest the question.
        return sorted(found, key=lambda item: item[2])

    def read_chunks(self, retrieved: list[tuple[DocumentRecord, ChunkRecord, float]]) -> list:
        """The stored tensors of the retrieved chunks (None for each the store lacks): the
        store reads of a query, no model."""
        return self.store.get_many([self.chunk_key(record.tenant, chunk.chunk_hash) for record, chunk, _ in retrieved])

    def load_chunks(
        self,
        tenant: str,
        retrieved: list[tuple[DocumentRecord, ChunkRecord, float]],
        stored: list | None = None,
        entries: list | None = None,
    ) -> tuple[list[LoadedChunk], list[int]]:
        """KV of the retrieved chunks, and the indices of those recomputed: a chunk missing
        from the store (evicted, corrupt, another model) is recomputed from the document
        text and written back. `stored`, when given, receives each chunk's tensors as read
        (sparse decode uses its codes); `entries`: what `read_chunks` read (None: read now)."""
        entries = self.read_chunks(retrieved) if entries is None else entries
        loaded, recomputed = [], []
        for index, ((record, chunk, _), tensors) in enumerate(zip(retrieved, entries)):
            if tensors is None:
                token_ids = self._chunk_tokens(tenant, record, chunk)
                tensors = self.engine.encode_chunk(token_ids, self.calibrated.codebook)
                self.store.put(self.chunk_key(record.tenant, chunk.chunk_hash), tensors)
                recomputed.append(index)
            loaded.append(LoadedChunk(tensors["tokens"].tolist(), *self.engine.kv_format.unpack(tensors)))
            if stored is not None:
                stored.append(tensors)
        if recomputed:
            log.warning("recomputed %d chunk(s) missing from the store", len(recomputed))
        return loaded, recomputed

    def _chunk_tokens(self, tenant: str, record: DocumentRecord, chunk: ChunkRecord) -> list[int]:
        text = self.registry.text(tenant, record.doc_id)
        return self.engine.tokenize(text)[chunk.token_start : chunk.token_end]

    def prepare(self, question: str, tenant: str, config: QueryConfig) -> PreparedQuery:
        return self.compute(self.fetch(question, tenant, config), config)

    def fetch(self, question: str, tenant: str, config: QueryConfig) -> QueryInputs:
        """A question's inputs, no model: its chunks retrieved, their stored tensors read,
        their citations."""
        check_tenant(tenant)
        if not question or not question.strip():
            raise InputError("empty_question", "the question is empty")
        started = time.perf_counter()
        retrieved = self.retrieve(question, tenant, config.top_k, config.doc_ids, config.retrieval, config.filter)
        if not retrieved and (config.filter is not None or config.retrieval == "bm25"):
            raise InputError(
                "no_documents",
                "nothing to answer from: no document matches the filter, or (bm25 "
                "retrieval) none holds a word of the question",
            )
        if not retrieved:
            raise InputError("no_documents", "no documents to answer from: ingest some first")
        retrieve_s = time.perf_counter() - started
        load_started = time.perf_counter()
        entries = self.read_chunks(retrieved)
        load_s = time.perf_counter() - load_started
        return QueryInputs(question, tenant, retrieved, entries, self.cite(tenant, retrieved), retrieve_s, load_s)

    def compute(self, inputs: QueryInputs, config: QueryConfig) -> PreparedQuery:
        """The model side of a question: missing chunks recomputed, then the fusion."""
        timings: dict[str, float] = {"retrieve": inputs.retrieve_s}
        load_started = time.perf_counter()
        stored: list = []
        chunks, missing = self.load_chunks(inputs.tenant, inputs.retrieved, stored, inputs.entries)
        timings["load"] = inputs.load_s + time.perf_counter() - load_started
        segments = self.engine.prompt.rag_segments(inputs.question)
        fusion_input = FusionInput(
            segments.prefix_ids,
            chunks,
            segments.question_ids,
            len(self.engine.chunk_prefix_ids),
            segments.question_text_span,
        )
        self.check_fits(Layout.of(fusion_input), config)
        fuse_started = time.perf_counter()
        strategy = config.fusion.build(self.calibrated.fusion)
        result = strategy.fuse(
            self.engine.model, fusion_input, self.engine.chunk_prefix_cache(), config.generation.max_new_tokens
        )
        timings["fuse"] = time.perf_counter() - fuse_started
        chunk_codes = sparse_chunk_codes(self.engine, self.calibrated.codebook, config.sparse, chunks, stored)
        hashes = [chunk.chunk_hash for _, chunk, _ in inputs.retrieved]
        return PreparedQuery(result, inputs.citations, timings, strategy.name, hashes, chunk_codes, tuple(missing))

    def cite(self, tenant: str, retrieved: list[tuple[DocumentRecord, ChunkRecord, float]]) -> list[Citation]:
        """Citations of retrieved chunks, most relevant first."""
        texts: dict[str, str] = {}
        citations = []
        for record, chunk, score in reversed(retrieved):
            text = texts.get(record.doc_id) or texts.setdefault(
                record.doc_id, self.registry.text(tenant, record.doc_id)
            )
            citations.append(
                Citation(
                    record.doc_id,
                    record.name,
                    chunk.index,
                    chunk.char_start,
                    chunk.char_end,
                    round(score, 4),
                    text[chunk.char_start : chunk.char_end],
                    *record.page_span(chunk.char_start, chunk.char_end),
                )
            )
        return citations

    def check_fits(self, layout: Layout, config: QueryConfig) -> None:
        """InputError unless the prompt and its answer fit the model's context, and SnapKV
        (when asked for) can keep the prefix and question rows it must keep."""
        check_context_length(
            self.engine,
            layout.length,
            config.generation.max_new_tokens,
            f"the prompt (top_k {config.top_k})",
            "lower top_k or max_tokens",
        )
        capacity = config.sparse.snapkv_capacity if config.sparse is not None else None
        fixed = layout.prefix_len + (layout.length - layout.question_start)
        if capacity is not None and capacity < layout.length and capacity < fixed:
            raise InputError(
                "snapkv_capacity_too_small",
                f"snapkv_capacity is {capacity}, below the {fixed} prefix and question rows SnapKV must "
                f"keep; ask for at least {fixed} (or none)",
            )
