"""Ingestion: validate, chunk, precompute each new chunk's KV, store it, register the document.

Failure policy: input is validated before any work. Chunk blobs are written as they are
computed (memory stays bounded by one chunk); the registry commit that makes the
document visible is one LMDB transaction at the end. If anything fails before that
commit, the chunk blobs this ingestion added and no document references are deleted
again, so the store is left as it was. If the process dies instead, the ingestion
journal (ingest/journal.py), written before the first blob, lets the next start-up
delete them. A store that cannot take a blob fails the ingestion (StoreUnavailableError):
the KV never goes nowhere silently.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from ragkv.ingest.cleanup import delete_document
from ragkv.ingest.chunker import DEFAULT_CHUNK_TOKENS, chunk_document
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.errors import InputError
from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.registry import ChunkRecord, DocumentRecord, Registry, check_tenant
from ragkv.ingest.validation import DEFAULT_MAX_DOCUMENT_BYTES, check_text
from ragkv.engine import Engine
from ragkv.engine.fingerprint import KV_FORMAT_VERSION
from ragkv.store.base import ChunkStore
from ragkv.store.keys import ChunkKey, hash_tokens

log = logging.getLogger("ragkv.ingest")

Progress = Callable[[int, int], None]
"""Called with (chunks done, chunks total) as ingestion advances."""


def chunk_key(engine: Engine, chunk_hash: str) -> ChunkKey:
    """Where `engine`'s KV of a chunk lives in the store."""
    return ChunkKey(engine.fingerprint, chunk_hash, KV_FORMAT_VERSION)


@dataclass(frozen=True)
class IngestConfig:
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Tokens per chunk; the last chunk of a document may be shorter."""
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES
    """Larger documents are refused with a clear error."""
    show_progress: bool = True
    """Draw a progress bar on stderr while chunks are precomputed."""
    share_chunks_across_tenants: bool = False
    """Let tenants share chunk KV and document ids for identical text. Off by default: each
    tenant's chunk keys and document ids are salted with the tenant, so ingesting a text
    another tenant holds reveals nothing (no reuse, a different id)."""

    def __post_init__(self) -> None:
        if not 16 <= self.chunk_tokens <= 8192:
            raise InputError("bad_chunk_tokens", f"chunk_tokens must be in [16, 8192], got {self.chunk_tokens}")
        if self.max_document_bytes < 1:
            raise ValueError("max_document_bytes must be positive")


@dataclass
class IngestResult:
    doc_id: str
    name: str
    chunks: int
    tokens: int
    computed_chunks: int
    reused_chunks: int
    seconds: float
    duplicate_of_existing: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    stored_bytes: int = 0
    """Bytes of chunk KV blobs this ingestion wrote (chunks already in the store cost none)."""
    stored_tokens: int = 0
    """Tokens of the chunks it wrote."""

    @property
    def bytes_per_token(self) -> float:
        """What one token of this document costs in the store, in the engine's KV format."""
        return self.stored_bytes / self.stored_tokens if self.stored_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _text_hash(text: str, namespace: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    if namespace:
        digest.update(namespace.encode() + b"\x00")  # tenant names hold no NUL
    digest.update(text.encode())
    return digest.hexdigest()


class Ingestor:
    def __init__(self, engine: Engine, store: ChunkStore, registry: Registry, embedder: Embedder, journal: IngestJournal,
                 config: IngestConfig = IngestConfig()):
        self.engine = engine
        self.journal = journal
        self.store = store
        self.registry = registry
        self.embedder = embedder
        self.config = config
        context = engine.spec.rope.max_position_embeddings
        if len(engine.chunk_prefix_ids) + config.chunk_tokens > context:
            raise InputError("bad_chunk_tokens", f"chunk_tokens {config.chunk_tokens} does not fit the model's context of "
                             f"{context} positions (with its {len(engine.chunk_prefix_ids)}-token chunk prefix)")

    def chunk_key(self, chunk_hash: str) -> ChunkKey:
        return chunk_key(self.engine, chunk_hash)

    def ingest_text(
        self,
        text: str,
        name: str,
        *,
        tenant: str = "default",
        metadata: dict | None = None,
        progress: Progress | None = None,
    ) -> IngestResult:
        started = time.perf_counter()
        check_tenant(tenant)
        text = check_text(text, name, self.config.max_document_bytes)
        if metadata is not None and not isinstance(metadata, dict):
            raise InputError("bad_metadata", "metadata must be a JSON object")
        namespace = "" if self.config.share_chunks_across_tenants else tenant
        text_hash = _text_hash(text, namespace)
        existing = self.registry.find_by_text(tenant, text_hash)
        if existing is not None:
            record = self.registry.get(tenant, existing)
            return IngestResult(record.doc_id, record.name, len(record.chunks), record.num_tokens, 0, len(record.chunks),
                                time.perf_counter() - started, duplicate_of_existing=True)

        chunks = chunk_document(self.engine.tokenizer, text, self.config.chunk_tokens)
        hashes = [hash_tokens(chunk.token_ids, namespace) for chunk in chunks]
        todo = self._missing(chunks, hashes)
        added: list[ChunkKey] = []
        timings = {"precompute": 0.0, "store_write": 0.0}
        journal_entry = self.journal.begin(self.chunk_key(h) for _, h in todo) if todo else None
        try:
            stored_bytes, stored_tokens = self._precompute(name, todo, added, timings, progress)
            embed_started = time.perf_counter()
            embeddings = self.embedder.embed_passages([text[c.char_start : c.char_end] for c in chunks])
            timings["embed"] = time.perf_counter() - embed_started
            record = DocumentRecord(
                doc_id="doc_" + text_hash[:16],
                tenant=tenant,
                name=name,
                text_hash=text_hash,
                num_tokens=sum(c.num_tokens for c in chunks),
                chunk_tokens=self.config.chunk_tokens,
                fingerprint=self.engine.fingerprint,
                created=time.time(),
                chunks=[
                    ChunkRecord(c.index, h, c.index * self.config.chunk_tokens,
                                c.index * self.config.chunk_tokens + c.num_tokens, c.char_start, c.char_end)
                    for c, h in zip(chunks, hashes)
                ],
                metadata=dict(metadata or {}),
            )
            self.registry.add(record, text, embeddings)
        except BaseException:
            self._roll_back(added)
            raise
        finally:
            if journal_entry is not None:
                self.journal.end(journal_entry)
        computed = len(todo)
        return IngestResult(record.doc_id, name, len(chunks), record.num_tokens, computed, len(chunks) - computed,
                            time.perf_counter() - started, timings=timings, stored_bytes=stored_bytes,
                            stored_tokens=stored_tokens)

    def _missing(self, chunks, hashes) -> list:
        """(chunk, hash) of the chunks the store lacks, each once (a chunk can repeat)."""
        todo = [(chunk, h) for chunk, h in zip(chunks, hashes) if not self.store.contains(self.chunk_key(h))]
        return list({h: (chunk, h) for chunk, h in todo}.values())

    def _precompute(self, name, unique, added, timings, progress) -> tuple[int, int]:
        """Encode and store each chunk of `unique`; returns the blob bytes and tokens written."""
        bar = tqdm(total=len(unique), desc=f"precompute {name}", unit="chunk", disable=not self.config.show_progress or not unique)
        stored_bytes = stored_tokens = 0
        for done, (chunk, chunk_hash) in enumerate(unique, start=1):
            t0 = time.perf_counter()
            tensors = self.engine.encode_chunk(chunk.token_ids)
            t1 = time.perf_counter()
            key = self.chunk_key(chunk_hash)
            added.append(key)  # first: a put that fails half-way may still have written
            stored_bytes += self.store.put(key, tensors, required=True)
            stored_tokens += chunk.num_tokens
            timings["precompute"] += t1 - t0
            timings["store_write"] += time.perf_counter() - t1
            bar.update(1)
            if progress is not None:
                progress(done, len(unique))
        bar.close()
        return stored_bytes, stored_tokens

    def _roll_back(self, added: list[ChunkKey]) -> None:
        for key in added:
            if self.registry.refcount(key.chunk_hash) == 0:
                self.store.delete(key)
        if added:
            log.warning("ingestion failed; removed %d chunk blobs it had written", len(added))

    def delete(self, doc_id: str, tenant: str = "default") -> DocumentRecord:
        return delete_document(self.registry, self.store, tenant, doc_id)
