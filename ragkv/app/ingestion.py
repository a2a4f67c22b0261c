"""Ingestion as the application offers it to the API: reading an upload, checking a
document's text, and the types an ingestion reports (its result, the stored record).

The API reads documents through this module so that it needs no part of ragkv.ingest
(loaders, validation, the pipeline): those stay the application's to compose.
"""

from __future__ import annotations

from ragkv.ingest.loaders import SUPPORTED_SUFFIXES, LoadedDocument, load_document
from ragkv.ingest.pipeline import IngestResult
from ragkv.ingest.registry import ChunkRecord, DocumentRecord
from ragkv.ingest.validation import check_text

UPLOAD_SUFFIXES = SUPPORTED_SUFFIXES
"""File name endings an upload may have (or none: then it is read as text)."""

UPLOAD_MEDIA_TYPES = (
    "text/plain",
    "text/markdown",
    "text/html",
    "text/csv",
    "application/pdf",
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
)
"""The media types of those files, as the published schema declares them."""


def read_upload(data: bytes, name: str, max_bytes: int) -> LoadedDocument:
    """The text (and PDF pages) of an uploaded file; InputError when it is unusable."""
    return load_document(data, name, max_bytes)


def check_document_text(text: str, name: str, max_bytes: int) -> str:
    """The text of a document sent as JSON; InputError when it is empty, too large or binary."""
    return check_text(text, name, max_bytes)


__all__ = [
    "UPLOAD_MEDIA_TYPES",
    "UPLOAD_SUFFIXES",
    "ChunkRecord",
    "DocumentRecord",
    "IngestResult",
    "check_document_text",
    "read_upload",
]
