"""Documents as the engine client ingests them: which document a new one replaces, and
the record a background ingestion keeps (what the API's /v1/jobs reads).

A new document replaces nothing, or, when asked to, the tenant's newest document of the
same name. A new version of a document keeps its id, and its name and metadata unless it
gives new ones; it keeps a PDF's pages when its text is unchanged (an edit of the
metadata alone)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ragkv.app.ingest_records import CANCELLED, FAILED, SUCCEEDED, IngestRecord, IngestRecords
from ragkv.app.ingestion import DocumentRecord, IngestResult
from ragkv.app.request import RequestCancelled
from ragkv.app.server.task import Task
from ragkv.ingest.registry import DocumentRegistry


@dataclass(frozen=True)
class Ingestion:
    """A document to ingest, and the id of the one it replaces."""

    tenant: str
    text: str
    name: str
    metadata: dict | None = None
    pages: list[list[int]] | None = None
    """[char start, char end) of each page (PDF); None for formats without pages."""
    replaces: str | None = None


@dataclass(frozen=True)
class IngestedDocument:
    """What an ingestion ends with: the registry's record of the document, and the figures."""

    record: DocumentRecord
    result: IngestResult


class JobReport(Protocol):
    """How a front end wants a background ingestion's end kept in its record."""

    def result(self, done: IngestedDocument) -> dict:
        """The record's result when the ingestion succeeded."""

    def error(self, error: Exception, job_id: str) -> dict:
        """The record's error ({"code", "message"}) when it failed."""


def newest_named(registry: DocumentRegistry, tenant: str, name: str) -> str | None:
    """The id of the tenant's newest document called `name`, or None."""
    same_name = [record for record in registry.list(tenant) if record.name == name]
    return same_name[-1].doc_id if same_name else None  # the list is oldest first


def new_version(
    registry: DocumentRegistry,
    old: DocumentRecord,
    text: str,
    name: str | None,
    metadata: dict | None,
    pages: list[list[int]] | None,
) -> Ingestion:
    """The ingestion that replaces `old` in place; None keeps the old name or metadata."""
    if pages is None and old.pages and text == registry.text(old.tenant, old.doc_id):
        pages = old.pages
    metadata = old.metadata if metadata is None else metadata
    return Ingestion(old.tenant, text, name or old.name, metadata, pages, replaces=old.doc_id)


def tracked(records: IngestRecords, record: IngestRecord, body: Callable, report: JobReport) -> Callable:
    """Wrap an ingestion body so its record follows it (nobody awaits a background task)."""

    def steps(task: Task):
        records.start(record)
        try:
            done = yield from body(task)
        except RequestCancelled:
            records.finish(record, CANCELLED, error={"code": "cancelled", "message": "the job was cancelled"})
            raise
        except Exception as error:
            records.finish(record, FAILED, error=report.error(error, record.id))
            raise
        records.finish(record, SUCCEEDED, result=report.result(done))
        return done

    return steps
