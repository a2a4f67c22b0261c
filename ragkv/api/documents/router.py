"""Documents and ingestion jobs: POST/GET/PUT/DELETE /v1/documents, GET /v1/jobs.

PUT /v1/documents/{id} replaces a document by a new version (same id): its old chunks
leave retrieval when the new ones enter, in one registry step; chunks both versions
share keep their KV. POST adds a document beside any of the same name, unless it asks
for `replace` (then the tenant's newest document of that name is replaced, as by PUT)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Path, Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from ragkv.api.auth import tenant_of
from ragkv.api.common.protocol import DOC_ID_PATTERN, Deleted
from ragkv.api.documents.protocol import (
    DocumentCreate,
    DocumentCreated,
    DocumentDetail,
    DocumentList,
    JobAccepted,
    JobList,
    JobStatus,
    check_metadata,
)
from ragkv.api.documents.serving import (
    document_created,
    document_detail,
    document_summary,
    job_accepted,
    job_status,
    job_url,
)
from ragkv.api.errors import ApiError, as_api_error
from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.openapi import errors
from ragkv.api.state import AppState, app_state
from ragkv.api.streaming import run_task
from ragkv.app.errors import InputError
from ragkv.app.ingestion import UPLOAD_MEDIA_TYPES, UPLOAD_SUFFIXES, check_document_text, read_upload
from ragkv.app.server import IngestedDocument, Ingestion

log = logging.getLogger("ragkv.api")

router = APIRouter(tags=["documents"], default_response_class=SafeJSONResponse)

DocumentId = Annotated[str, Path(pattern=DOC_ID_PATTERN, description="1-128 characters of [A-Za-z0-9_.-]")]


@dataclass(frozen=True)
class Upload:
    """A document as a request carries it."""

    text: str
    name: str | None
    """None when the request named none."""
    metadata: dict | None
    background: bool | None
    pages: list[list[int]] | None = None
    replace: bool = False
    """POST: replace the tenant's newest document of the same name."""


def _pydantic_message(error: ValidationError) -> str:
    parts = []
    for problem in error.errors()[:5]:
        where = ".".join(str(p) for p in problem.get("loc", ())) or "body"
        parts.append(f"{where}: {problem.get('msg')}")
    return "; ".join(parts)


def _form_flag(value, name: str) -> bool | None:
    if value is None:
        return None
    flag = {"true": True, "false": False}.get(str(value).strip().lower())
    if flag is None:
        raise ApiError(400, "invalid_parameters", f"{name} must be true or false", param=name)
    return flag


_UPLOAD_STATUS = {
    **dict.fromkeys(("unsupported_type", "binary", "not_utf8"), 415),
    **dict.fromkeys(("empty", "unreadable", "encrypted", "no_text_layer"), 422),
}
"""An upload's refusals for what its file holds, which a schema cannot say (its `encoding`
lists the part types, which clients do not always send): none of the types served, or not
the text its name says, is a 415 as a body of another media type is; a file of a served
type that holds no text, or cannot be read as that type, is a 422."""


def _uploaded(data: bytes, name: str, limit: int):
    try:
        return read_upload(data, name, limit)
    except InputError as error:
        if error.reason in _UPLOAD_STATUS:
            raise ApiError(_UPLOAD_STATUS[error.reason], error.reason, str(error), param="file") from None
        raise


async def _read_document(request: Request, state: AppState) -> Upload:
    """The document of a JSON body or a multipart upload."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    limit = state.client.max_document_bytes
    if content_type == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=16)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError(
                400, "missing_file", "multipart uploads need a 'file' field holding the document", param="file"
            )
        given = form.get("name") or upload.filename
        name = str(given or "upload.txt")
        document = _uploaded(await upload.read(), name, limit)
        return Upload(
            document.text,
            str(given) if given else None,
            check_metadata(form.get("metadata")),
            _form_flag(form.get("background"), "background"),
            document.pages,
            bool(_form_flag(form.get("replace"), "replace")),
        )
    if content_type not in ("application/json", ""):
        raise ApiError(
            415,
            "unsupported_media_type",
            'send the document as JSON {"text": ..., "name": ...} or as multipart/form-data with a \'file\' field',
        )
    raw = await request.body()
    if not raw:
        raise ApiError(400, "empty_body", 'the request body is empty; send {"text": ..., "name": ...}')
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, "malformed_json", f"the request body is not valid JSON: {error}") from None
    try:
        document = DocumentCreate.model_validate(payload)
    except ValidationError as error:
        raise ApiError(400, "invalid_parameters", _pydantic_message(error)) from None
    named = document.name if "name" in document.model_fields_set else None
    return Upload(
        check_document_text(document.text, document.name, limit),
        named,
        check_metadata(document.metadata),
        document.background,
        replace=document.replace,
    )


_DOCUMENT_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/DocumentCreate"}},
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file"],
                "properties": {
                    "file": {
                        "type": "string",
                        "format": "binary",
                        "description": "the document, a file named "
                        + ", ".join(UPLOAD_SUFFIXES)
                        + " (or with no ending: read as text) that holds text",
                    },
                    "name": {"type": "string", "description": "its name (default: the file name)"},
                    "metadata": {"type": "object", "description": "a JSON object (the part's text)"},
                    "background": {"type": "boolean", "description": "force (true) or refuse (false) a background job"},
                    "replace": {
                        "type": "boolean",
                        "description": "POST: replace the newest document of the same name (default false)",
                    },
                },
            },
            "encoding": {
                "file": {"contentType": ", ".join(UPLOAD_MEDIA_TYPES)},
                "metadata": {"contentType": "application/json"},
            },
        },
    },
}


def _ingest_route(status: int, doing: str, *error_statuses: int) -> dict:
    """What POST and PUT /v1/documents declare: the body they read, the document created (or
    replaced) with `status`, a job accepted with 202."""
    done = {201: "ingested", 200: "replaced"}[status]
    return {
        "response_model": DocumentCreated,
        "openapi_extra": {"requestBody": _DOCUMENT_BODY},
        "responses": {
            status: {"model": DocumentCreated, "description": done},
            202: {"model": JobAccepted, "description": f"{doing} in the background: poll status_url"},
            **errors(*error_statuses),
        },
    }


@router.post("/v1/documents", status_code=201, **_ingest_route(201, "ingesting", 400, 401, 413, 415, 422, 503))
async def create_document(request: Request):
    """Ingest a document (JSON {text, name, metadata} or a multipart 'file' upload). Small
    documents answer 201 when ingested; large ones (or background=true) answer 202 with a
    job whose progress GET /v1/jobs/{id} reports. With `replace` true, the tenant's newest
    document of the same name is replaced (it keeps its id; 201 either way)."""
    state = app_state(request)
    upload = await _read_document(request, state)
    name = upload.name or "document.txt"
    ingestion = state.client.new_document(
        tenant_of(request), upload.text, name, upload.metadata, upload.pages, replace_same_name=upload.replace
    )
    return await _ingest(request, state, ingestion, upload.background)


@router.put(
    "/v1/documents/{doc_id}", status_code=200, **_ingest_route(200, "replacing", 400, 401, 404, 409, 413, 415, 422, 503)
)
async def replace_document(request: Request, doc_id: DocumentId):
    """Replace a document by a new version, keeping its id (same body as POST). Its old
    chunks leave retrieval when the new ones enter, in one step; chunks the versions share
    keep their KV. The name and metadata are kept unless the request gives new ones, and a
    PDF's pages when the text is unchanged (a JSON body that only edits the metadata)."""
    state = app_state(request)
    old = state.client.document(tenant_of(request), doc_id)  # 404 before the body is read
    upload = await _read_document(request, state)
    ingestion = state.client.new_version(old, upload.text, upload.name, upload.metadata, upload.pages)
    return await _ingest(request, state, ingestion, upload.background)


async def _ingest(
    request: Request, state: AppState, ingestion: Ingestion, background: bool | None
) -> DocumentCreated | SafeJSONResponse:
    """The ingested document (the route's status), or with a background job 202 and the job."""
    if background is None:
        background = len(ingestion.text.encode("utf-8", errors="surrogatepass")) > state.config.background_ingest_bytes
    if not background:
        done: IngestedDocument = await run_task(request, state.client.ingest(ingestion))
        return document_created(done.record, done.result)
    record = state.client.ingest_job(ingestion, _JobReport())
    # Not the route's response model: the 202 its `responses` declare.
    return SafeJSONResponse(
        job_accepted(record).model_dump(mode="json"), status_code=202, headers={"Location": job_url(record)}
    )


class _JobReport:
    """A background ingestion's end as GET /v1/jobs/{id} shows it."""

    def result(self, done: IngestedDocument) -> dict:
        return document_created(done.record, done.result).model_dump(mode="json")

    def error(self, error: Exception, job_id: str) -> dict:
        mapped = as_api_error(error)
        if mapped is None:
            log.error("ingestion job %s failed", job_id, exc_info=error)
            mapped = ApiError(500, "internal_error", f"ingestion failed; quote job id {job_id} to the operator")
        return {"code": mapped.code, "message": mapped.message}


@router.get("/v1/documents", response_model=DocumentList, responses=errors(401))
def list_documents(request: Request):
    state = app_state(request)
    records = state.client.documents(tenant_of(request))
    return DocumentList(data=[document_summary(record) for record in records])


@router.get("/v1/documents/{doc_id}", response_model=DocumentDetail, responses=errors(400, 401, 404))
def get_document(request: Request, doc_id: DocumentId, include_text: bool = False):
    state = app_state(request)
    tenant = tenant_of(request)
    record = state.client.document(tenant, doc_id)
    return document_detail(record, state.client.document_text(tenant, record.doc_id) if include_text else None)


@router.delete("/v1/documents/{doc_id}", response_model=Deleted, responses=errors(400, 401, 404, 503))
async def delete_document(request: Request, doc_id: DocumentId):
    state = app_state(request)
    record = await run_task(request, state.client.delete_document(tenant_of(request), doc_id))
    return Deleted(id=record.doc_id, object="document", deleted=True)


@router.get("/v1/jobs", response_model=JobList, responses=errors(401))
def list_jobs(request: Request):
    state = app_state(request)
    return JobList(data=[job_status(job) for job in state.client.jobs(tenant_of(request))])


@router.get("/v1/jobs/{job_id}", response_model=JobStatus, responses=errors(401, 404))
def get_job(request: Request, job_id: str):
    state = app_state(request)
    record = state.client.job(tenant_of(request), job_id)
    if record is None:
        raise ApiError(404, "not_found", f"no job {job_id!r}")
    return job_status(record)
