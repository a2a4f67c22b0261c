"""Documents and ingestion jobs: /v1/documents, /v1/jobs."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ragkv.api.protocol.common import omitted_when_none


class DocumentSummary(BaseModel):
    id: str
    name: str
    tokens: int
    chunks: int
    created: float
    metadata: dict[str, Any]
    pages: int | None = omitted_when_none("pages of a PDF (absent for formats without pages)")


class DocumentChunk(BaseModel):
    index: int
    tokens: int
    char_start: int
    char_end: int
    page: int | None = omitted_when_none("1-based page where the chunk starts (PDF)")
    page_end: int | None = omitted_when_none("1-based page where it ends (PDF)")


class DocumentDetail(DocumentSummary):
    fingerprint: str = Field(description="the model fingerprint the document's chunks were computed for")
    chunks: list[DocumentChunk]  # type: ignore[assignment]  # the detail lists them; the summary counts them
    text: str | None = omitted_when_none("the document's text (include_text=true)")


class DocumentList(BaseModel):
    object: str = "list"
    data: list[DocumentSummary]


class IngestSummary(BaseModel):
    chunks: int
    tokens: int
    computed_chunks: int = Field(description="chunks whose KV was computed by this ingestion")
    reused_chunks: int = Field(description="chunks whose KV the store already held")
    seconds: float
    stored_bytes: int = Field(description="bytes the computed chunks take in the store")
    bytes_per_token: float
    encode_tokens_per_second: float = Field(description="tokens of computed chunks per second of model time")
    duplicate_of_existing: bool
    replaced: bool = Field(description="the document was a new version of one with this id (PUT, or POST with replace)")


class DocumentCreated(BaseModel):
    document: DocumentSummary
    ingest: IngestSummary


class JobProgress(BaseModel):
    chunks_done: int
    chunks_total: int | None
    fraction: float | None


class JobError(BaseModel):
    code: str
    message: str


class JobStatus(BaseModel):
    id: str
    object: str = "job"
    kind: str
    name: str | None
    status: str = Field(description="queued, running, succeeded, failed or cancelled")
    progress: JobProgress
    result: DocumentCreated | None
    error: JobError | None
    created: float
    started: float | None
    finished: float | None


class JobAccepted(BaseModel):
    job: JobStatus
    status_url: str


class JobList(BaseModel):
    object: str = "list"
    data: list[JobStatus]
