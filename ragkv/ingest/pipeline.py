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
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

from tqdm import tqdm

from ragkv.engine import Engine
from ragkv.errors import InputError
from ragkv.ingest.chunk_keys import ChunkKeys
from ragkv.ingest.chunker import chunk_document
from ragkv.ingest.cleanup import delete_document
from ragkv.ingest.config import IngestConfig
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.registry import ChunkRecord, DocumentRecord, DocumentRegistry, check_tenant
from ragkv.ingest.validation import check_text
from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.store.base import ChunkStore
from ragkv.store.keys import ChunkKey

Result = TypeVar("Result")
log = logging.getLogger("ragkv.ingest")

Progress = Callable[[int, int], None]
"""Called with (chunks done, chunks total) as ingestion advances."""


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
    replaced: bool = False
    """The document was a new version of one the tenant had (same id, old chunks retired)."""

    @property
    def bytes_per_token(self) -> float:
        """What one token of this document costs in the store, in the engine's KV format."""
        return self.stored_bytes / self.stored_tokens if self.stored_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def encode_tokens_per_second(self) -> float:
        """Tokens of computed chunks per second of model time (the ingestion throughput)."""
        seconds = self.timings.get("precompute", 0.0)
        return self.stored_tokens / seconds if seconds else 0.0


def _text_hash(text: str, namespace: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    if namespace:
        digest.update(namespace.encode() + b"\x00")  # tenant names hold no NUL
    digest.update(text.encode())
    return digest.hexdigest()


class Ingestor:
    def __init__(
        self,
        engine: Engine,
        store: ChunkStore,
        registry: DocumentRegistry,
        embedder: Embedder,
        journal: IngestJournal,
        config: IngestConfig = IngestConfig(),
        *,
        codebook: A2ATSCodebook | None = None,
    ):
        self.engine = engine
        self.codebook = codebook
        """The model's A2ATS codebook, when calibrated: each stored chunk then carries its codes."""
        self.journal = journal
        self.store = store
        self.registry = registry
        self.embedder = embedder
        self.config = config
        self.keys = ChunkKeys.of(engine, config.share_chunks_across_tenants)
        context = engine.spec.rope.max_position_embeddings
        if len(engine.chunk_prefix_ids) + config.chunk_tokens > context:
            raise InputError(
                "bad_chunk_tokens",
                f"chunk_tokens {config.chunk_tokens} does not fit the model's context of "
                f"{context} positions (with its {len(engine.chunk_prefix_ids)}-token chunk prefix)",
            )

    def chunk_key(self, tenant: str, chunk_hash: str) -> ChunkKey:
        return self.keys.key(tenant, chunk_hash)

    def ingest_text(self, text: str, name: str, **options) -> IngestResult:
        """Ingest a document in one call (`ingest_steps` run to its end; same options)."""
        return run_steps(self.ingest_steps(text, name, **options))

    def ingest_steps(
        self,
        text: str,
        name: str,
        *,
        tenant: str = "default",
        metadata: dict | None = None,
        progress: Progress | None = None,
        pages: list[list[int]] | None = None,
        replaces: str | None = None,
    ) -> Generator[int, None, IngestResult]:
        """Ingest a document, one batch of chunk encodes per step: yields the chunks done
        after each batch and returns the IngestResult (the model worker interleaves the
        steps with decode steps). Closing the generator part-way rolls back what it wrote,
        as a failure does. `pages`: each page's [start, end) in `text` (PDF citations
        name the page). `replaces`: the id of the tenant's document this text is a new
        version of; the document keeps its id, its old chunks leave retrieval when the new
        ones enter (one registry step) and chunks both versions share are not recomputed."""
        started = time.perf_counter()
        check_tenant(tenant)
        text = check_text(text, name, self.config.max_document_bytes)
        if metadata is not None and not isinstance(metadata, dict):
            raise InputError("bad_metadata", "metadata must be a JSON object")
        namespace = self.keys.namespace(tenant)
        text_hash = _text_hash(text, namespace)
        old, existing = self._versions(tenant, name, text_hash, replaces)
        if existing is not None and not _changes(old if existing == replaces else None, name, metadata, pages):
            return (
                yield from self._fill_existing(self.registry.get(tenant, existing), text, tenant, started, progress)
            )
        # A new version with the same text but another name, metadata or pages goes on: its
        # chunks are all in the store, so only the embeddings are computed again.

        chunks = chunk_document(self.engine.tokenizer, text, self.config.chunk_tokens)
        hashes = [self.keys.digest(tenant, chunk.token_ids) for chunk in chunks]
        todo = self._missing(tenant, chunks, hashes)
        added: list[ChunkKey] = []
        timings = {"precompute": 0.0, "store_write": 0.0}
        # The old version's keys are journalled too: if the process dies after the replace
        # commits but before their blobs are deleted, the next start-up deletes the orphans.
        retiring = [self.chunk_key(tenant, c.chunk_hash) for c in old.chunks] if old else []
        noted = [key for _, key in todo] + retiring
        journal_entry = self.journal.begin(noted) if noted else None
        try:
            stored_bytes, stored_tokens = yield from self._precompute(name, todo, added, timings, progress)
            embed_started = time.perf_counter()
            embeddings = self.embedder.embed_passages([text[c.char_start : c.char_end] for c in chunks])
            timings["embed"] = time.perf_counter() - embed_started
            record = self._record(tenant, name, text_hash, chunks, hashes, old, metadata, pages)
            self._register(record, old, text, embeddings)
        except BaseException:
            self._roll_back(added)
            raise
        finally:
            if journal_entry is not None:
                self.journal.end(journal_entry)
        computed = len(todo)
        return IngestResult(
            record.doc_id,
            name,
            len(chunks),
            record.num_tokens,
            computed,
            len(chunks) - computed,
            time.perf_counter() - started,
            timings=timings,
            stored_bytes=stored_bytes,
            stored_tokens=stored_tokens,
            replaced=old is not None,
        )

    def _versions(
        self, tenant: str, name: str, text_hash: str, replaces: str | None
    ) -> tuple[DocumentRecord | None, str | None]:
        """(the document `replaces` names, the id of the tenant's document with this exact
        text), refusing a new version whose text another document holds."""
        old = self.registry.get(tenant, replaces) if replaces is not None else None  # NotFoundError first
        existing = self.registry.find_by_text(tenant, text_hash)
        if existing is not None and existing != replaces and replaces is not None:
            raise InputError(
                "duplicate_text",
                f"{name}: document {existing} already holds this exact text; delete one of the two or change the text",
            )
        return old, existing

    def _record(
        self,
        tenant: str,
        name: str,
        text_hash: str,
        chunks: list,
        hashes: list[str],
        old: DocumentRecord | None,
        metadata: dict | None,
        pages: list[list[int]] | None,
    ) -> DocumentRecord:
        """The registry's record of a new document, or of a new version of `old` (its id, and
        its metadata unless given)."""
        size = self.config.chunk_tokens
        return DocumentRecord(
            doc_id=old.doc_id if old else "doc_" + text_hash[:16],
            tenant=tenant,
            name=name,
            text_hash=text_hash,
            num_tokens=sum(c.num_tokens for c in chunks),
            chunk_tokens=size,
            fingerprint=self.engine.fingerprint,
            created=time.time(),
            chunks=[
                ChunkRecord(c.index, h, c.index * size, c.index * size + c.num_tokens, c.char_start, c.char_end)
                for c, h in zip(chunks, hashes)
            ],
            metadata=dict(metadata if metadata is not None else old.metadata if old else {}),
            pages=pages,
        )

    def _register(self, record: DocumentRecord, old: DocumentRecord | None, text: str, embeddings) -> None:
        """Add the document, or swap the new version in for `old` in one registry step and
        delete the blobs only the old one used."""
        if old is None:
            self.registry.add(record, text, embeddings)
            return
        _, orphans = self.registry.replace(record, text, embeddings)
        for chunk_hash in orphans:  # other models' blobs of them are left to `ragkv store gc`
            self.store.delete(self.chunk_key(record.tenant, chunk_hash))

    def _fill_existing(
        self, record: DocumentRecord, text: str, tenant: str, started: float, progress: Progress | None
    ) -> Generator[int, None, IngestResult]:
        """Identical text is registered already: make sure its KV is in this store (the
        registry may have been filled through another store), computing what is missing."""
        chunks = chunk_document(self.engine.tokenizer, text, record.chunk_tokens)
        hashes = [self.keys.digest(tenant, chunk.token_ids) for chunk in chunks]
        if hashes != [c.chunk_hash for c in record.chunks]:
            # Another tokenizer made the record: its chunks are recomputed at question time.
            log.warning("%s: registered by another model's tokenizer; its chunk KV is not filled in", record.name)
            todo = []
        else:
            todo = self._missing(tenant, chunks, hashes)
        added: list[ChunkKey] = []
        timings = {"precompute": 0.0, "store_write": 0.0}
        stored_bytes = stored_tokens = 0
        if todo:
            log.warning(
                "%s: registered already, but %d of its %d chunks are missing from this store; computing them",
                record.name,
                len(todo),
                len(chunks),
            )
            journal_entry = self.journal.begin(key for _, key in todo)
            try:
                stored_bytes, stored_tokens = yield from self._precompute(record.name, todo, added, timings, progress)
            except BaseException:
                self._roll_back(added)
                raise
            finally:
                self.journal.end(journal_entry)
        return IngestResult(
            record.doc_id,
            record.name,
            len(record.chunks),
            record.num_tokens,
            len(todo),
            len(record.chunks) - len(todo),
            time.perf_counter() - started,
            duplicate_of_existing=True,
            timings=timings,
            stored_bytes=stored_bytes,
            stored_tokens=stored_tokens,
        )

    def _missing(self, tenant: str, chunks, hashes) -> list:
        """(chunk, key) of the chunks the store lacks, each once (a chunk can repeat)."""
        keyed = [(chunk, self.chunk_key(tenant, h)) for chunk, h in zip(chunks, hashes)]
        return list({key: (chunk, key) for chunk, key in keyed if not self.store.contains(key)}.values())

    def _precompute(self, name, unique, added, timings, progress) -> Generator[int, None, tuple[int, int]]:
        """Encode and store each chunk of `unique` (in batches of up to the configured tokens:
        memory stays bounded by one batch), yielding the chunks done after each batch;
        returns the blob bytes and tokens written."""
        bar = tqdm(
            total=len(unique),
            desc=f"precompute {name}",
            unit="chunk",
            disable=not self.config.show_progress or not unique,
        )
        stored_bytes = stored_tokens = done = 0
        try:
            for batch in self._batches(unique):
                for chunk, written in self._encode_batch(batch, added, timings):
                    stored_bytes += written
                    stored_tokens += chunk.num_tokens
                    done += 1
                    bar.update(1)
                    if progress is not None:
                        progress(done, len(unique))
                yield done
        finally:
            bar.close()
        return stored_bytes, stored_tokens

    def _encode_batch(self, batch, added, timings):
        """Encode one batch of (chunk, key) and put each blob; yields (chunk, bytes written)."""
        t0 = time.perf_counter()
        if len(batch) == 1:
            encoded = [self.engine.encode_chunk(batch[0][0].token_ids, self.codebook)]
        else:
            encoded = self.engine.encode_chunks([chunk.token_ids for chunk, _ in batch], self.codebook)
        timings["precompute"] += time.perf_counter() - t0
        for (chunk, key), tensors in zip(batch, encoded):
            t1 = time.perf_counter()
            added.append(key)  # first: a put that fails half-way may still have written
            written = self.store.put(key, tensors, required=True)
            timings["store_write"] += time.perf_counter() - t1
            yield chunk, written

    def _batches(self, unique: list) -> list[list]:
        """`unique` cut into runs of at most `encode_batch_tokens` tokens; a chunk of a
        quarter of the budget or more runs alone (see IngestConfig.encode_batch_tokens)."""
        budget = self.config.encode_batch_tokens
        batches: list[list] = []
        tokens, extendable = 0, False
        for item in unique:
            size = item[0].num_tokens
            if 4 * size >= budget:
                batches.append([item])
                extendable = False
            elif extendable and tokens + size <= budget:
                batches[-1].append(item)
                tokens += size
            else:
                batches.append([item])
                tokens, extendable = size, True
        return batches

    def _roll_back(self, added: list[ChunkKey]) -> None:
        for key in added:
            if self.registry.refcount(key.chunk_hash) == 0:
                self.store.delete(key)
        if added:
            log.warning("ingestion failed; removed %d chunk blobs it had written", len(added))

    def delete(self, doc_id: str, tenant: str = "default") -> DocumentRecord:
        return delete_document(self.registry, self.store, tenant, doc_id)


def run_steps(steps: Generator[object, None, Result]) -> Result:
    """Run a step generator (an ingestion's, a contextualization's) to the end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def _changes(old: DocumentRecord | None, name: str, metadata: dict | None, pages: list[list[int]] | None) -> bool:
    """Whether a new version of `old` with the same text changes its record."""
    if old is None:
        return False
    return name != old.name or (metadata is not None and metadata != old.metadata) or (pages or None) != old.pages
