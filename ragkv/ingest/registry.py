"""The document registry: documents, their texts, chunk reference counts and the chunk
embeddings retrieval searches, per tenant.

`DocumentRegistry` is the contract; the backends are `LMDBDocumentRegistry` (embedded, the data folder's
LMDB environment: replicas on one host) and `RedisDocumentRegistry` (a Redis server: replicas on
several hosts). `open_registry` (registry_url.py) picks one from a URL.

What every backend guarantees (tests/test_registry_contract.py):
- a document's record, text, embeddings and chunk references are added or removed
  atomically, so a failure or a concurrent reader never sees half a document;
- adding a document id that exists changes nothing (two replicas ingesting the same
  text at once count its chunks once);
- replacing a document swaps its versions in one step: a reader sees the old or the new
  version whole, never both or neither;
- every add/remove/replace bumps the tenant's generation and logs the document it touched in the
  same atomic write; each search checks the generation, and a process's retrieval index
  (ingest/index/) applies the logged changes it has not seen, so a replica sees documents
  another one added without re-reading every vector.
"""

from __future__ import annotations

import bisect
import json
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ragkv.errors import InputError

if TYPE_CHECKING:
    from ragkv.ingest.index.retrieval import RetrievalIndex

CHANGE_LOG_KEEP = 100_000
"""Change log entries a backend keeps per tenant; an index further behind is rebuilt."""

_TENANT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_tenant(tenant: str) -> str:
    if not tenant or len(tenant) > 64 or not set(tenant) <= _TENANT_CHARS:
        raise InputError("bad_tenant", f"tenant must be 1-64 characters of [A-Za-z0-9_.-], got {tenant!r}")
    return tenant


@dataclass(frozen=True)
class ChunkRecord:
    index: int
    chunk_hash: str
    token_start: int
    token_end: int
    char_start: int
    char_end: int


@dataclass(frozen=True)
class DocumentRecord:
    doc_id: str
    tenant: str
    name: str
    text_hash: str
    num_tokens: int
    chunk_tokens: int
    fingerprint: str
    created: float
    chunks: list[ChunkRecord]
    metadata: dict = field(default_factory=dict)
    pages: list[list[int]] | None = None
    """[char start, char end) of each page in the text, page 1 first (PDF); None for
    formats without pages."""

    def page_of(self, char: int) -> int | None:
        """The 1-based page holding text offset `char` (a chunk starting between two pages
        belongs to the next); None without pages."""
        if not self.pages:
            return None
        page = max(bisect.bisect_right([start for start, _ in self.pages], char), 1)
        if char >= self.pages[page - 1][1] and page < len(self.pages):
            page += 1
        return page

    def page_span(self, char_start: int, char_end: int) -> tuple[int, int] | tuple[None, None]:
        """(first, last) 1-based pages the text [char_start, char_end) lies on: the page of
        its start and the last page that starts before its end; (None, None) without pages."""
        first = self.page_of(char_start)
        if first is None:
            return None, None
        last = bisect.bisect_left([start for start, _ in self.pages or ()], char_end)
        return first, max(first, min(last, len(self.pages or ())))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview) -> DocumentRecord:
        data = json.loads(bytes(raw))
        data["chunks"] = [ChunkRecord(**chunk) for chunk in data["chunks"]]
        return cls(**data)

    def summary(self) -> dict:
        return {
            "id": self.doc_id,
            "name": self.name,
            "tokens": self.num_tokens,
            "chunks": len(self.chunks),
            "created": self.created,
            "metadata": self.metadata,
        }

    def detail(self) -> dict:
        """The summary plus the model fingerprint and each chunk's span (GET /v1/documents/{id})."""
        return {
            **self.summary(),
            "fingerprint": self.fingerprint,
            "chunks": [
                {
                    "index": c.index,
                    "tokens": c.token_end - c.token_start,
                    "char_start": c.char_start,
                    "char_end": c.char_end,
                }
                for c in self.chunks
            ],
        }


@dataclass(frozen=True)
class SearchHit:
    doc_id: str
    chunk_index: int
    score: float


class DocumentRegistry(ABC):
    """The registry contract; `search` (cosine top-k through the retrieval index) is shared."""

    backend: str
    """Short name of the backend ("lmdb", "redis"), for /health and logs."""

    def __init__(self) -> None:
        self.index_folder: Path | None = None
        """Where the retrieval indexes live (the data folder's index/); None: in memory."""
        self._index: RetrievalIndex | None = None
        self._lock = threading.Lock()

    # -- reads -----------------------------------------------------------------------

    @abstractmethod
    def find_by_text(self, tenant: str, text_hash: str) -> str | None:
        """The id of the tenant's document with this text hash, if any."""

    @abstractmethod
    def get(self, tenant: str, doc_id: str) -> DocumentRecord:
        """The document's record; NotFoundError if the tenant has no such document."""

    @abstractmethod
    def text(self, tenant: str, doc_id: str) -> str:
        """The document's text; NotFoundError if the tenant has no such document."""

    @abstractmethod
    def list(self, tenant: str) -> list[DocumentRecord]:
        """The tenant's documents, oldest first."""

    @abstractmethod
    def refcount(self, chunk_hash: str) -> int:
        """How many documents (of any tenant) use the chunk."""

    @abstractmethod
    def generation(self, tenant: str) -> int:
        """A counter that grows by one with every change of the tenant's documents."""

    @abstractmethod
    def changes(self, tenant: str, after: int) -> list[tuple[int, str]]:
        """(generation, doc_id) of the logged changes after generation `after`, oldest
        first; the log keeps the last CHANGE_LOG_KEEP (a gap means entries were dropped)."""

    @abstractmethod
    def document_vectors(self, tenant: str, doc_id: str) -> tuple[DocumentRecord, np.ndarray] | None:
        """The document's record and chunk embeddings (rows in chunk order), read together;
        None when the tenant has no such document."""

    @abstractmethod
    def identity(self) -> str:
        """Names the registry's storage, so an index built from another one is not reused."""

    # -- writes (atomic each) ----------------------------------------------------------

    def add(self, record: DocumentRecord, text: str, embeddings: np.ndarray) -> bool:
        """Add a document with one embedding per chunk; False (and nothing changed) when
        the tenant already has a document with this id."""
        if embeddings.ndim != 2 or embeddings.shape[0] != len(record.chunks):
            raise ValueError("one embedding per chunk is required")
        return self._add(record, text, np.ascontiguousarray(embeddings, dtype=np.float32))

    @abstractmethod
    def _add(self, record: DocumentRecord, text: str, embeddings: np.ndarray) -> bool: ...

    @abstractmethod
    def remove(self, tenant: str, doc_id: str) -> tuple[DocumentRecord, list[str]]:
        """Delete a document; return it and the chunk hashes no document uses any more."""

    def replace(self, record: DocumentRecord, text: str, embeddings: np.ndarray) -> tuple[DocumentRecord, list[str]]:
        """Put a new version in place of the tenant's document `record.doc_id` in one atomic
        step: its old chunks leave retrieval as the new ones enter, chunks both versions use
        keep their references throughout (their KV is never orphaned). Returns the old
        record and the chunk hashes no document uses any more; NotFoundError if there is no
        such document."""
        if embeddings.ndim != 2 or embeddings.shape[0] != len(record.chunks):
            raise ValueError("one embedding per chunk is required")
        return self._replace(record, text, np.ascontiguousarray(embeddings, dtype=np.float32))

    @abstractmethod
    def _replace(
        self, record: DocumentRecord, text: str, embeddings: np.ndarray
    ) -> tuple[DocumentRecord, list[str]]: ...

    def close(self) -> None:
        """Release what the backend holds (connections; an environment it opened). Backends
        call `close_index` first."""

    def close_index(self) -> None:
        """Write the retrieval index's pending snapshots and close its files."""
        with self._lock:
            index, self._index = self._index, None
        if index is not None:
            index.close()

    def healthy(self) -> bool | None:
        """Whether the registry's server answers; None for an embedded backend (no server)."""
        return None

    # -- retrieval -------------------------------------------------------------------

    @abstractmethod
    def _embeddings(self, tenant: str) -> tuple[int, list[tuple[str, int]], np.ndarray]:
        """(generation, [(doc_id, chunk index)], matrix) read as one consistent snapshot,
        rows ordered by (doc_id, chunk index): what an index is rebuilt from."""

    @property
    def index(self) -> RetrievalIndex:
        """The retrieval indexes over this registry (opened on first use)."""
        with self._lock:
            if self._index is None:
                from ragkv.ingest.index.retrieval import RetrievalIndex

                self._index = RetrievalIndex(self, self.index_folder)
            return self._index

    def search(
        self, tenant: str, query_vector: np.ndarray, top_k: int, doc_ids: set[str] | None = None
    ) -> list[SearchHit]:
        """Cosine top-k over the tenant's chunks (optionally only within `doc_ids`); equal
        scores keep (doc_id, chunk index) order, so every backend ranks alike."""
        hits = self.index.search_dense(tenant, np.asarray(query_vector, dtype=np.float32), top_k, doc_ids)
        return [SearchHit(hit.doc_id, hit.chunk_index, hit.score) for hit in hits]
