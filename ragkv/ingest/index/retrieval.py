"""The retrieval indexes of one registry: per tenant a dense index (dense.py) and a BM25
index (bm25.py), kept current from the registry's change log and searched alone or fused.

Freshness: each search reads the tenant's generation (one LMDB read or one Redis GET).
An index behind it applies the log entries after its own generation, reading only the
documents they name, so an ingestion costs the index O(its chunks), not O(corpus). An index
that is missing, unreadable, another registry's, ahead of the registry (a registry that
was reset) or further behind than the log keeps is rebuilt from the registry.

On disk (`folder`, the data folder's index/): `{tenant}.dense.npz`, a snapshot written after
a rebuild and, when changes were applied since, as the registry closes (never on the query
path: a process that dies replays the log from its last snapshot next time);
`{tenant}.bm25.sqlite`, written as it changes. Without a folder both live in memory.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ragkv.ingest.errors import NotFoundError
from ragkv.ingest.index.bm25 import Bm25Index
from ragkv.ingest.index.dense import DenseConfig, DenseHit, DenseIndex
from ragkv.ingest.index.filters import MetadataFilter
from ragkv.ingest.index.hybrid import HybridConfig, check_mode, reciprocal_rank_fusion

if TYPE_CHECKING:
    from ragkv.ingest.registry import DocumentRegistry

log = logging.getLogger("ragkv.ingest.index")


@dataclass(frozen=True)
class IndexConfig:
    dense: DenseConfig = field(default_factory=DenseConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)


@dataclass
class _Tenant:
    lock: threading.RLock = field(default_factory=threading.RLock)
    dense: DenseIndex | None = None
    loaded: bool = False
    """Whether the snapshot on disk was tried (once per process)."""
    unsaved_rows: int = 0
    bm25: Bm25Index | None = None


@dataclass
class FollowStats:
    """What keeping the indexes current cost (tests count reads with it)."""

    rebuilds: int = 0
    applied_changes: int = 0
    documents_read: int = 0


class RetrievalIndex:
    def __init__(self, registry: DocumentRegistry, folder: Path | None, config: IndexConfig = IndexConfig()):
        self.registry = registry
        self.folder = Path(folder) if folder is not None else None
        self.config = config
        self.identity = registry.identity()
        self.stats = FollowStats()
        self._tenants: dict[str, _Tenant] = {}
        self._lock = threading.Lock()

    def _tenant(self, tenant: str) -> _Tenant:
        with self._lock:
            return self._tenants.setdefault(tenant, _Tenant())

    def _path(self, tenant: str, suffix: str) -> Path | None:
        return self.folder / f"{tenant}.{suffix}" if self.folder is not None else None

    # -- dense ------------------------------------------------------------------------

    def dense(self, tenant: str) -> DenseIndex:
        """The tenant's dense index, brought up to the registry's current generation."""
        state = self._tenant(tenant)
        now = self.registry.generation(tenant)
        with state.lock:
            if not state.loaded:
                state.loaded = True
                path = self._path(tenant, "dense.npz")
                if path is not None and path.exists():
                    state.dense = DenseIndex.load(path, self.identity, self.config.dense)
                    if state.dense is None:
                        log.warning("the dense index %s is unusable: rebuilding it from the registry", path)
            index = state.dense
            if index is not None and index.generation == now:
                return index
            if index is not None and index.generation < now and self._catch_up_dense(tenant, state, index):
                return index
            state.dense = self._rebuild_dense(tenant)
            state.unsaved_rows = 0
            self._snapshot(tenant, state)
            return state.dense

    def _catch_up_dense(self, tenant: str, state: _Tenant, index: DenseIndex) -> bool:
        changed = self._changed_documents(tenant, index.generation)
        if changed is None:
            return False
        generation, doc_ids = changed
        for doc_id in doc_ids:
            before = index.chunks_of(doc_id)
            found = self.registry.document_vectors(tenant, doc_id)
            self.stats.documents_read += 1
            if found is None:
                index.remove_document(doc_id)
            else:
                record, vectors = found
                index.add_document(doc_id, record.metadata, vectors)
            state.unsaved_rows += before + (len(found[1]) if found is not None else 0)
        index.generation = generation
        self.stats.applied_changes += len(doc_ids)
        return True

    def _changed_documents(self, tenant: str, after: int) -> tuple[int, list[str]] | None:
        """(the generation the log reaches, the documents changed since `after`), or None
        when the log no longer holds every change since then."""
        changes = self.registry.changes(tenant, after)
        generations = [generation for generation, _ in changes]
        if not changes or generations != list(range(after + 1, after + 1 + len(changes))):
            return None
        return generations[-1], list(dict.fromkeys(doc_id for _, doc_id in changes))

    def _rebuild_dense(self, tenant: str) -> DenseIndex:
        self.stats.rebuilds += 1
        generation, owners, matrix = self.registry._embeddings(tenant)
        metadata = {record.doc_id: record.metadata for record in self.registry.list(tenant)}
        documents, start = [], 0
        for end in range(1, len(owners) + 1):
            if end == len(owners) or owners[end][0] != owners[start][0]:
                doc_id = owners[start][0]
                documents.append((doc_id, metadata.get(doc_id, {}), matrix[start:end]))
                start = end
        dim = matrix.shape[1] if matrix.ndim == 2 and matrix.shape[1] else 0
        return DenseIndex.build(dim, documents, self.config.dense, generation)

    def _snapshot(self, tenant: str, state: _Tenant) -> None:
        path = self._path(tenant, "dense.npz")
        if path is None or state.dense is None:
            return
        try:
            state.dense.save(path, self.identity)
            state.unsaved_rows = 0
        except OSError as error:  # a cache: the next process rebuilds it
            log.warning("could not write the dense index %s: %s", path, error)

    # -- bm25 -------------------------------------------------------------------------

    def bm25(self, tenant: str) -> Bm25Index:
        state = self._tenant(tenant)
        now = self.registry.generation(tenant)
        with state.lock:
            if state.bm25 is None:
                state.bm25 = Bm25Index(self._path(tenant, "bm25.sqlite"), self.identity)
            index = state.bm25
            held = index.generation
            if held == now:
                return index
            changed = self._changed_documents(tenant, held) if 0 <= held < now else None
            if changed is not None:
                generation, doc_ids = changed
                removed, added = [], []
                for doc_id in doc_ids:
                    texts = self._chunk_texts(tenant, doc_id)
                    (removed.append(doc_id) if texts is None else added.append((doc_id, texts)))
                index.apply(generation, removed, added)
                self.stats.applied_changes += len(doc_ids)
                return index
            self.stats.rebuilds += 1
            generation = now
            documents = []
            for record in self.registry.list(tenant):
                texts = self._chunk_texts(tenant, record.doc_id, record)
                if texts is not None:
                    documents.append((record.doc_id, texts))
            index.rebuild(generation, documents)
            return index

    def _chunk_texts(self, tenant: str, doc_id: str, record=None) -> list[str] | None:
        try:
            record = record or self.registry.get(tenant, doc_id)
            text = self.registry.text(tenant, doc_id)
        except NotFoundError:
            return None
        self.stats.documents_read += 1
        return [text[chunk.char_start : chunk.char_end] for chunk in record.chunks]

    # -- search -----------------------------------------------------------------------

    def allowed(self, tenant: str, metadata_filter: MetadataFilter | None, doc_ids: set[str] | None) -> set[str] | None:
        """The documents a search may return from (None: all of the tenant's)."""
        if metadata_filter is None:
            return doc_ids
        index = self.dense(tenant)
        candidates = doc_ids if doc_ids is not None else index.metadata.keys()
        return {doc for doc in candidates if doc in index and metadata_filter.matches(index.metadata[doc])}

    def search_dense(self, tenant: str, vector: np.ndarray, top_k: int, allowed: set[str] | None) -> list[DenseHit]:
        index = self.dense(tenant)
        with self._tenant(tenant).lock:
            return index.search(vector, top_k, allowed)

    def search_bm25(self, tenant: str, text: str, top_k: int, allowed: set[str] | None) -> list[DenseHit]:
        return [DenseHit(doc, chunk, score) for doc, chunk, score in self.bm25(tenant).search(text, top_k, allowed)]

    def search(
        self, tenant: str, mode: str, vector: np.ndarray | None, text: str, top_k: int, allowed: set[str] | None
    ) -> list[DenseHit]:
        """The top_k chunks of `allowed` documents (None: all) by `mode`: dense (cosine of
        `vector`), bm25 (of `text`) or hybrid (both fused by reciprocal rank)."""
        check_mode(mode)
        if mode == "dense":
            return self.search_dense(tenant, vector, top_k, allowed)
        if mode == "bm25":
            return self.search_bm25(tenant, text, top_k, allowed)
        depth = self.config.hybrid.candidates(top_k)
        rankings = [self.search_dense(tenant, vector, depth, allowed), self.search_bm25(tenant, text, depth, allowed)]
        return reciprocal_rank_fusion(rankings, top_k, self.config.hybrid.rrf_k)

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Write the snapshots that changed since their last one; close the BM25 files."""
        with self._lock:
            tenants = list(self._tenants.items())
        for tenant, state in tenants:
            with state.lock:
                if state.dense is not None and state.unsaved_rows:
                    self._snapshot(tenant, state)
                if state.bm25 is not None:
                    state.bm25.close()
                    state.bm25 = None
