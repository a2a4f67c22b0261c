"""/v1/documents and /v1/jobs bodies from the registry's records and ingestion results."""

from __future__ import annotations

from ragkv.api.documents.protocol import (
    DocumentChunk,
    DocumentCreated,
    DocumentDetail,
    DocumentSummary,
    IngestSummary,
    JobAccepted,
    JobProgress,
    JobStatus,
)
from ragkv.app.ingest_records import IngestRecord
from ragkv.app.ingestion import DocumentRecord, IngestResult


def document_summary(record: DocumentRecord) -> DocumentSummary:
    return DocumentSummary(
        id=record.doc_id,
        name=record.name,
        tokens=record.num_tokens,
        chunks=len(record.chunks),
        created=record.created,
        metadata=record.metadata,
        pages=len(record.pages) if record.pages else None,
    )


def document_detail(record: DocumentRecord, text: str | None = None) -> DocumentDetail:
    """`text`: the document's text, when the request asked for it."""
    return DocumentDetail(
        **document_summary(record).model_dump(exclude={"chunks"}),
        fingerprint=record.fingerprint,
        chunks=[
            DocumentChunk(
                index=c.index,
                tokens=c.token_end - c.token_start,
                char_start=c.char_start,
                char_end=c.char_end,
                **dict(zip(("page", "page_end"), record.page_span(c.char_start, c.char_end))),
            )
            for c in record.chunks
        ],
        text=text,
    )


def ingest_summary(result: IngestResult) -> IngestSummary:
    """The result's fields by name, the rates and seconds rounded."""
    values = {name: getattr(result, name) for name in IngestSummary.model_fields}
    values.update(
        seconds=round(result.seconds, 3),
        bytes_per_token=round(result.bytes_per_token, 1),
        encode_tokens_per_second=round(result.encode_tokens_per_second, 1),
    )
    return IngestSummary(**values)


def document_created(record: DocumentRecord, result: IngestResult) -> DocumentCreated:
    return DocumentCreated(document=document_summary(record), ingest=ingest_summary(result))


def job_status(record: IngestRecord) -> JobStatus:
    return JobStatus(
        id=record.id,
        kind=record.kind,
        name=record.name,
        status=record.status,
        progress=JobProgress(
            chunks_done=record.chunks_done, chunks_total=record.chunks_total, fraction=record.fraction
        ),
        result=record.result,
        error=record.error,
        created=record.created,
        started=record.started,
        finished=record.finished,
    )


def job_accepted(record: IngestRecord) -> JobAccepted:
    return JobAccepted(job=job_status(record), status_url=job_url(record))


def job_url(record: IngestRecord) -> str:
    return f"/v1/jobs/{record.id}"
