"""Chunks that carry context: a chunk's stored K/V recomputed after the chunks it is likely
to meet in a prompt.

Ingestion computes each chunk's K/V after the RAG prefix alone, so its rows never saw
another passage; fused into a prompt, those rows are what the recompute must correct, and
what it leaves uncorrected is what the answer drifts on. FusionRAG (arXiv 2601.12904)
computes a chunk's stored K/V with related chunks before it instead. Here, after a
document is ingested, each of its chunks is recomputed in the context of its document's
preceding chunk (when it has one) and its nearest chunks by embedding among the tenant's
other chunks, up to `neighbours`: the context's stored K/V is placed at its positions
(nothing of it recomputed), the chunk's own rows are computed at every layer against it,
and their pre-RoPE K/V replace the chunk's blob under the same key. The context is read
as stored before any chunk of the batch is rewritten, so the result does not depend on
the order chunks are visited in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from dataclasses import dataclass

import torch

from ragkv.engine.core import Engine
from ragkv.fusion import FusionInput, LoadedChunk
from ragkv.fusion.pie import Pie
from ragkv.ingest.chunk_keys import ChunkKeys
from ragkv.ingest.pipeline import run_steps
from ragkv.ingest.registry import DocumentRecord, DocumentRegistry
from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.store.base import ChunkStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextResult:
    chunks: int
    """Chunks whose stored K/V was recomputed in context."""
    tokens: int
    """Their tokens (the rows computed)."""
    context_tokens: int
    """Tokens placed before them, summed over the chunks (read, not computed)."""
    seconds: float


@dataclass(frozen=True)
class _Chunk:
    doc_id: str
    index: int
    chunk_hash: str


class ChunkContextualizer:
    def __init__(
        self,
        engine: Engine,
        store: ChunkStore,
        registry: DocumentRegistry,
        neighbours: int,
        share_across_tenants: bool = False,
        codebook: A2ATSCodebook | None = None,
    ):
        """`neighbours`: chunks placed before each chunk (IngestConfig.context_neighbours);
        `codebook`: the model's A2ATS codebook, whose codes the rewritten blobs carry."""
        if neighbours < 1:
            raise ValueError("a contextualizer needs at least one neighbour")
        self.engine, self.store, self.registry, self.neighbours = engine, store, registry, neighbours
        self.keys = ChunkKeys.of(engine, share_across_tenants)
        self.codebook = codebook
        # the fusion needs a last segment it computes; one newline-like token costs nothing
        self._tail = engine.tokenize("\n")[-1:] or [0]

    def contextualize(self, tenant: str, doc_ids: list[str]) -> ContextResult:
        """Recompute the stored K/V of every chunk of `doc_ids` in its context."""
        return run_steps(self.contextualize_steps(tenant, doc_ids))

    def contextualize_steps(self, tenant: str, doc_ids: list[str]) -> Generator[int, None, ContextResult]:
        """`contextualize` one chunk per step: yields the chunks done so far (the model
        worker runs decode steps between them). The blobs are written after the last step,
        so a generator closed part-way leaves every chunk as ingestion stored it."""
        started = time.perf_counter()
        self._records: dict[tuple[str, str], DocumentRecord] = {}
        plans = [plan for doc_id in doc_ids for plan in self._plans(tenant, doc_id)]
        needed = {c.chunk_hash for chunk, context in plans for c in (chunk, *context)}
        stored = dict(zip(needed, self.store.get_many([self.keys.key(tenant, h) for h in needed])))
        results = []
        for chunk, context in plans:
            placed = [stored[c.chunk_hash] for c in context if stored[c.chunk_hash] is not None]
            own = stored[chunk.chunk_hash]
            if not placed or own is None:
                continue  # nothing to read it after, or evicted: it keeps (or gets) the plain K/V
            results.append((chunk, placed, self._in_context(own["tokens"].tolist(), placed)))
            yield len(results)
        tokens = context_tokens = 0
        for chunk, placed, tensors in results:
            self.store.put(self.keys.key(tenant, chunk.chunk_hash), tensors)
            tokens += int(tensors["tokens"].numel())
            context_tokens += sum(int(t["tokens"].numel()) for t in placed)
        return ContextResult(len(results), tokens, context_tokens, time.perf_counter() - started)

    def _plans(self, tenant: str, doc_id: str) -> list[tuple[_Chunk, list[_Chunk]]]:
        """(chunk, its context in prompt order, nearest last) for each chunk of the document."""
        found = self.registry.document_vectors(tenant, doc_id)
        if found is None:
            return []
        record, vectors = found
        plans = []
        for position, chunk in enumerate(record.chunks):
            context = [_Chunk(doc_id, position - 1, record.chunks[position - 1].chunk_hash)] if position else []
            wanted = self.neighbours - len(context)
            if wanted > 0:
                context = self._nearest(tenant, record, position, vectors[position], wanted) + context
            plans.append((_Chunk(doc_id, position, chunk.chunk_hash), context[-self.neighbours :]))
        return plans

    def _record(self, tenant: str, doc_id: str) -> DocumentRecord:
        """A neighbour's record, read once per contextualize call (many chunks share neighbours)."""
        key = (tenant, doc_id)
        if key not in self._records:
            self._records[key] = self.registry.get(tenant, doc_id)
        return self._records[key]

    def _nearest(self, tenant: str, record: DocumentRecord, position: int, vector, count: int) -> list[_Chunk]:
        """Up to `count` of the tenant's chunks nearest `vector`, other than this chunk and
        its predecessor, farthest first (the nearest sits next to the chunk)."""
        skip = {(record.doc_id, position), (record.doc_id, position - 1)}
        hits = self.registry.index.search_dense(tenant, vector, count + len(skip), None)
        chosen, hashes = [], {record.chunks[position].chunk_hash}
        for hit in hits:
            if (hit.doc_id, hit.chunk_index) in skip or len(chosen) == count:
                continue
            other = record if hit.doc_id == record.doc_id else self._record(tenant, hit.doc_id)
            chunk_hash = other.chunks[hit.chunk_index].chunk_hash
            if chunk_hash not in hashes:
                hashes.add(chunk_hash)
                chosen.append(_Chunk(hit.doc_id, hit.chunk_index, chunk_hash))
        return chosen[::-1]

    def _in_context(self, token_ids: list[int], context: list[dict]) -> dict[str, torch.Tensor]:
        return stored_in_context(self.engine, token_ids, context, self._tail, self.codebook)


def stored_in_context(
    engine: Engine,
    token_ids: list[int],
    context: list[dict],
    tail: list[int] | None = None,
    codebook: A2ATSCodebook | None = None,
) -> dict[str, torch.Tensor]:
    """The stored blob of the chunk `token_ids` computed after the stored chunks `context`
    (blobs, in prompt order; their K/V placed, not recomputed). `ragkv calibrate fusion`
    uses it too, so what it calibrates on is what ingestion stores."""
    if tail is None:
        tail = engine.tokenize("\n")[-1:] or [0]
    chunks = [LoadedChunk(t["tokens"].tolist(), *engine.kv_format.unpack(t)) for t in context]
    chunks.append(LoadedChunk(token_ids))
    prefix = list(engine.chunk_prefix_ids)
    fusion_input = FusionInput(prefix, chunks, tail, chunk_precompute_offset=len(prefix))
    # pie places every stored row and computes only the rows without stored K/V: the
    # chunk itself, and the one-token tail the fusion needs
    result = Pie().fuse(engine.model, fusion_input, engine.chunk_prefix_cache())
    keys, values = result.fresh_chunk_kv(len(chunks) - 1)
    return engine.stored_chunk(token_ids, keys, values, codebook)
