"""Documents and ingestion jobs, /v1/documents and /v1/jobs: the JSON body read, the metadata check, the bodies sent."""

from __future__ import annotations

import json
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
)

from ragkv.api.common.protocol import (
    NOT_BLANK_SCHEMA,
    NotBlank,
    StrictRequest,
    omitted_when_none,
    unpaired_surrogate_at,
)
from ragkv.api.errors import ApiError


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


MAX_METADATA_BYTES = 16 * 1024


class DocumentCreate(StrictRequest):
    text: NotBlank = Field(json_schema_extra=NOT_BLANK_SCHEMA, description="the document's text")
    name: str = Field("document.txt", min_length=1, max_length=256, description="a name shown in citations")
    metadata: dict[str, Any] | None = Field(
        None, description=f"a JSON object kept with the document (at most {MAX_METADATA_BYTES} bytes)"
    )
    background: StrictBool | None = Field(
        None, description="force (true) or refuse (false) a background job; default by size"
    )
    replace: StrictBool = Field(
        False,
        description="POST only: a document of the same name replaces the tenant's newest one of that "
        "name (as PUT does) instead of being added beside it",
    )


def check_metadata(metadata: Any) -> dict | None:
    if metadata is None:
        return None
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as error:
            raise ApiError(400, "bad_metadata", f"metadata is not valid JSON: {error}", param="metadata") from None
    if not isinstance(metadata, dict):
        raise ApiError(400, "bad_metadata", "metadata must be a JSON object", param="metadata")
    where = unpaired_surrogate_at(metadata, "metadata")
    if where is not None:
        raise ApiError(
            400,
            "bad_metadata",
            f"{where} holds an unpaired UTF-16 surrogate: text must be valid Unicode",
            param="metadata",
        )
    if len(json.dumps(metadata)) > MAX_METADATA_BYTES:
        raise ApiError(
            413, "metadata_too_large", f"metadata must be at most {MAX_METADATA_BYTES} bytes of JSON", param="metadata"
        )
    return metadata
