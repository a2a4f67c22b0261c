"""The document registry: documents, their texts, chunk reference counts and the chunk
embeddings retrieval searches, per tenant.

`Registry` is the contract; the backends are `LMDBRegistry` (embedded, the data folder's
LMDB environment: replicas on one host) and `RedisRegistry` (a Redis server: replicas on
several hosts). `open_registry` (registry_url.py) picks one from a URL.

What every backend guarantees (tests/test_registry_contract.py):
- a document's record, text, embeddings and chunk references are added or removed
  atomically, so a failure or a concurrent reader never sees half a document;
- adding a document id that exists changes nothing (two replicas ingesting the same
  text at once count its chunks once);
- every add/remove bumps the tenant's generation, a counter the per-process embedding
  matrix cache checks on each search, so a replica sees documents another one added.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field

import numpy as np

from ragkv.ingest.errors import InputError

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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview) -> "DocumentRecord":
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
        return {**self.summary(), "fingerprint": self.fingerprint,
                "chunks": [{"index": c.index, "tokens": c.token_end - c.token_start, "char_start": c.char_start,
                            "char_end": c.char_end} for c in self.chunks]}


@dataclass(frozen=True)
class SearchHit:
    doc_id: str
    chunk_index: int
    score: float


class Registry(ABC):
    """The registry contract; `search` (cosine top-k over a cached matrix) is shared."""

    backend: str
    """Short name of the backend ("lmdb", "redis"), for /health and logs."""

    def __init__(self) -> None:
        # Per-tenant embedding matrices with the generation they were read at.
        self._matrix_cache: dict[str, tuple[int, list[tuple[str, int]], np.ndarray]] = {}
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
        """A counter that changes whenever the tenant's documents do."""

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

    def close(self) -> None:
        """Release what the backend holds (connections; an environment it opened)."""

    def healthy(self) -> bool | None:
        """Whether the registry's server answers; None for an embedded backend (no server)."""
        return None

    # -- retrieval -------------------------------------------------------------------

    @abstractmethod
    def _embeddings(self, tenant: str) -> tuple[int, list[tuple[str, int]], np.ndarray]:
        """(generation, [(doc_id, chunk index)], matrix) read as one consistent snapshot,
        rows ordered by (doc_id, chunk index)."""

    def _matrix(self, tenant: str) -> tuple[list[tuple[str, int]], np.ndarray]:
        generation = self.generation(tenant)
        with self._lock:
            cached = self._matrix_cache.get(tenant)
        if cached is not None and cached[0] == generation:
            return cached[1], cached[2]
        generation, owners, matrix = self._embeddings(tenant)
        with self._lock:
            self._matrix_cache[tenant] = (generation, owners, matrix)
        return owners, matrix

    def search(self, tenant: str, query_vector: np.ndarray, top_k: int, doc_ids: set[str] | None = None) -> list[SearchHit]:
        """Cosine top-k over the tenant's chunks (optionally only within `doc_ids`); equal
        scores keep (doc_id, chunk index) order, so every backend ranks alike."""
        owners, matrix = self._matrix(tenant)
        if not owners:
            return []
        scores = matrix @ query_vector.astype(np.float32)
        if doc_ids is not None:
            allowed = np.array([doc in doc_ids for doc, _ in owners])
            scores = np.where(allowed, scores, -np.inf)
        order = np.argsort(-scores, kind="stable")[:top_k]
        return [SearchHit(owners[i][0], owners[i][1], float(scores[i])) for i in order if np.isfinite(scores[i])]
