"""The document registry and embedding index, in the same LMDB environment as the chunks.

Sub-databases (keys are UTF-8):
  documents   {tenant}/{doc_id}              -> JSON document record
  doc_by_text {tenant}/{text_hash}           -> doc_id (re-ingesting identical text reuses it)
  texts       {tenant}/{doc_id}              -> the document's UTF-8 text (citations, recompute)
  chunk_refs  {chunk_hash}                   -> number of documents that use the chunk
  embeddings  {tenant}/{doc_id}/{index:06d}  -> float32 embedding of one chunk
  registry_meta generation/{tenant}          -> counter bumped by every add/remove of the
                                                tenant's documents (other processes sharing
                                                the environment see their cache is stale)

A document's record, text, embeddings and chunk references change in one write
transaction, so a failure leaves the registry as it was.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field

import numpy as np

from ragkv.ingest.errors import InputError, NotFoundError
from ragkv.store.lmdb_env import LMDBEnvironment

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


class Registry:
    def __init__(self, env: LMDBEnvironment):
        self.env = env
        self._documents = env.db("documents")
        self._by_text = env.db("doc_by_text")
        self._texts = env.db("texts")
        self._refs = env.db("chunk_refs")
        self._embeddings = env.db("embeddings")
        self._meta = env.db("registry_meta")
        # Per-tenant embedding matrices with the generation they were built at, rebuilt when
        # the tenant's documents change (here or in another process on the same environment).
        self._matrix_cache: dict[str, tuple[int, list[tuple[str, int]], np.ndarray]] = {}
        self._lock = threading.Lock()

    # -- reads -----------------------------------------------------------------------

    def find_by_text(self, tenant: str, text_hash: str) -> str | None:
        with self.env.read() as txn:
            raw = txn.get(f"{tenant}/{text_hash}".encode(), db=self._by_text)
            return bytes(raw).decode() if raw is not None else None

    def get(self, tenant: str, doc_id: str) -> DocumentRecord:
        with self.env.read() as txn:
            raw = txn.get(f"{tenant}/{doc_id}".encode(), db=self._documents)
            if raw is None:
                raise NotFoundError(f"no document {doc_id!r}")
            return DocumentRecord.from_json(raw)

    def text(self, tenant: str, doc_id: str) -> str:
        with self.env.read() as txn:
            raw = txn.get(f"{tenant}/{doc_id}".encode(), db=self._texts)
            if raw is None:
                raise NotFoundError(f"no document {doc_id!r}")
            return bytes(raw).decode()

    def list(self, tenant: str) -> list[DocumentRecord]:
        prefix = f"{tenant}/".encode()
        records = []
        with self.env.read() as txn:
            cursor = txn.cursor(db=self._documents)
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not bytes(key).startswith(prefix):
                        break
                    records.append(DocumentRecord.from_json(value))
        return sorted(records, key=lambda record: record.created)

    def refcount(self, chunk_hash: str) -> int:
        with self.env.read() as txn:
            raw = txn.get(chunk_hash.encode(), db=self._refs)
            return int(bytes(raw)) if raw is not None else 0

    # -- writes (one transaction each) -----------------------------------------------

    def add(self, record: DocumentRecord, text: str, embeddings: np.ndarray) -> None:
        if embeddings.shape[0] != len(record.chunks):
            raise ValueError("one embedding per chunk is required")

        def write(txn) -> None:
            key = f"{record.tenant}/{record.doc_id}".encode()
            txn.put(key, record.to_json(), db=self._documents)
            txn.put(key, text.encode(), db=self._texts)
            txn.put(f"{record.tenant}/{record.text_hash}".encode(), record.doc_id.encode(), db=self._by_text)
            for chunk, vector in zip(record.chunks, embeddings):
                txn.put(
                    f"{record.tenant}/{record.doc_id}/{chunk.index:06d}".encode(),
                    np.ascontiguousarray(vector, dtype=np.float32).tobytes(),
                    db=self._embeddings,
                )
            for chunk_hash in {chunk.chunk_hash for chunk in record.chunks}:
                raw = txn.get(chunk_hash.encode(), db=self._refs)
                count = int(bytes(raw)) if raw is not None else 0
                txn.put(chunk_hash.encode(), str(count + 1).encode(), db=self._refs)
            self._bump_generation(txn, record.tenant)

        self.env.write(write)
        self._invalidate(record.tenant)

    def remove(self, tenant: str, doc_id: str) -> tuple[DocumentRecord, list[str]]:
        """Delete a document; return it and the chunk hashes no document uses any more."""

        def write(txn) -> tuple[DocumentRecord, list[str]]:
            key = f"{tenant}/{doc_id}".encode()
            raw = txn.get(key, db=self._documents)
            if raw is None:
                raise NotFoundError(f"no document {doc_id!r}")
            record = DocumentRecord.from_json(raw)
            txn.delete(key, db=self._documents)
            txn.delete(key, db=self._texts)
            txn.delete(f"{tenant}/{record.text_hash}".encode(), db=self._by_text)
            for chunk in record.chunks:
                txn.delete(f"{tenant}/{doc_id}/{chunk.index:06d}".encode(), db=self._embeddings)
            orphans = []
            for chunk_hash in {chunk.chunk_hash for chunk in record.chunks}:
                raw_count = txn.get(chunk_hash.encode(), db=self._refs)
                count = int(bytes(raw_count)) - 1 if raw_count is not None else 0
                if count > 0:
                    txn.put(chunk_hash.encode(), str(count).encode(), db=self._refs)
                else:
                    txn.delete(chunk_hash.encode(), db=self._refs)
                    orphans.append(chunk_hash)
            self._bump_generation(txn, tenant)
            return record, orphans

        result = self.env.write(write)
        self._invalidate(tenant)
        return result

    # -- retrieval -------------------------------------------------------------------

    def _generation(self, txn, tenant: str) -> int:
        raw = txn.get(f"generation/{tenant}".encode(), db=self._meta)
        return int(bytes(raw)) if raw is not None else 0

    def _bump_generation(self, txn, tenant: str) -> None:
        txn.put(f"generation/{tenant}".encode(), str(self._generation(txn, tenant) + 1).encode(), db=self._meta)

    def _invalidate(self, tenant: str) -> None:
        with self._lock:
            self._matrix_cache.pop(tenant, None)

    def _matrix(self, tenant: str) -> tuple[list[tuple[str, int]], np.ndarray]:
        with self.env.read() as txn:
            generation = self._generation(txn, tenant)
        with self._lock:
            cached = self._matrix_cache.get(tenant)
        if cached is not None and cached[0] == generation:
            return cached[1], cached[2]
        owners, vectors = [], []
        prefix = f"{tenant}/".encode()
        with self.env.read() as txn:
            generation = self._generation(txn, tenant)
            cursor = txn.cursor(db=self._embeddings)
            if cursor.set_range(prefix):
                for key, value in cursor:
                    key = bytes(key)
                    if not key.startswith(prefix):
                        break
                    _, doc_id, index = key.decode().rsplit("/", 2)
                    owners.append((doc_id, int(index)))
                    vectors.append(np.frombuffer(bytes(value), dtype=np.float32))
        matrix = np.stack(vectors) if vectors else np.zeros((0, 0), dtype=np.float32)
        with self._lock:
            self._matrix_cache[tenant] = (generation, owners, matrix)
        return owners, matrix

    def search(self, tenant: str, query_vector: np.ndarray, top_k: int, doc_ids: set[str] | None = None) -> list[SearchHit]:
        """Cosine top-k over the tenant's chunks (optionally only within `doc_ids`)."""
        owners, matrix = self._matrix(tenant)
        if not owners:
            return []
        scores = matrix @ query_vector.astype(np.float32)
        if doc_ids is not None:
            allowed = np.array([doc in doc_ids for doc, _ in owners])
            scores = np.where(allowed, scores, -np.inf)
        order = np.argsort(-scores)[:top_k]
        return [SearchHit(owners[i][0], owners[i][1], float(scores[i])) for i in order if np.isfinite(scores[i])]

