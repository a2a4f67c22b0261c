"""Ingestion settings. A module of its own, free of model code, so `ragkv ingest` can
build its options and refuse unusable files before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.errors import InputError
from ragkv.ingest.chunker import DEFAULT_CHUNK_TOKENS
from ragkv.ingest.validation import DEFAULT_MAX_DOCUMENT_BYTES

MAX_CONTEXT_NEIGHBOURS = 8


@dataclass(frozen=True)
class IngestConfig:
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Tokens per chunk; the last chunk of a document may be shorter."""
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES
    """Larger documents are refused with a clear error (for PDF and Office files: their
    extracted text; the file itself may be a few times larger, see ingest.formats)."""
    show_progress: bool = True
    """Draw a progress bar on stderr while chunks are precomputed."""
    share_chunks_across_tenants: bool = False
    """Let tenants share chunk KV and document ids for identical text. Off by default: each
    tenant's chunk keys and document ids are salted with the tenant, so ingesting a text
    another tenant holds reveals nothing (no reuse, a different id)."""
    encode_batch_tokens: int = 512
    """Short chunks are encoded together, up to this many tokens per model pass, so their
    rows share each weight matmul; a chunk of a quarter of this or more runs alone (longer
    chunks already fill the matmuls: stacking them measured no faster). 0 = one by one."""

    context_neighbours: int = 2
    """After a document is ingested, recompute each chunk's stored K/V with this many chunks
    placed before it: its document's preceding chunk, then its nearest chunks by embedding
    (ragkv.ingest.chunk_context); 0 = after the RAG prefix alone. Costs a fusion per chunk at
    ingestion (about twice the ingestion time); fused answers then start from rows that saw
    related text, at the same query cost and store size. 2 by default: the fusion table on
    held-out examples (BENCHMARKS.md) measured the largest gain in agreement with the full
    prefill of any setting that keeps the query's speed."""

    def __post_init__(self) -> None:
        if not 0 <= self.context_neighbours <= MAX_CONTEXT_NEIGHBOURS:
            raise InputError(
                "bad_context_neighbours",
                f"context_neighbours must be in [0, {MAX_CONTEXT_NEIGHBOURS}], got {self.context_neighbours}",
            )
        if not 16 <= self.chunk_tokens <= 8192:
            raise InputError("bad_chunk_tokens", f"chunk_tokens must be in [16, 8192], got {self.chunk_tokens}")
        if self.max_document_bytes < 1:
            raise ValueError("max_document_bytes must be positive")
        if self.encode_batch_tokens < 0:
            raise ValueError("encode_batch_tokens must be >= 0")
