"""The OpenAPI document (/openapi.json) and the Swagger UI at /docs, served offline.

Routes declare their success bodies and the error statuses they send (`errors(...)`);
this module adds what holds for every route: the bearer API key on /v1/, 401, 429 and 413
where the middleware sends them, and no 422 (validation errors are 400, in the OpenAI
error shape). The Swagger UI assets ship in the package (ragkv/api/static): no CDN.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from ragkv.api.common.protocol import ErrorResponse
from ragkv.api.config import ServeConfig
from ragkv.api.documents.protocol import DocumentCreate

SWAGGER_ASSETS = Path(__file__).resolve().parent / "static" / "swagger-ui"
ASSETS_PATH = "/docs/assets"
# The 1.5 MB bundle ships gzipped (0.4 MB) and is sent as it is, with Content-Encoding.
SWAGGER_BUNDLE_GZ = SWAGGER_ASSETS / "swagger-ui-bundle.js.gz"
SECURITY_SCHEME = "bearerAuth"
PROTECTED_PREFIX = "/v1/"


def capped_fields(limits: ServeConfig) -> list[tuple[str, str, int]]:
    return [
        ("QueryRequest", "top_k", limits.max_top_k),
        ("ChatRag", "top_k", limits.max_top_k),
        ("CompletionRag", "top_k", limits.max_top_k),
        ("QueryRequest", "max_tokens", limits.max_new_tokens),
        ("ChatRequest", "max_tokens", limits.max_new_tokens),
        ("ChatRequest", "max_completion_tokens", limits.max_new_tokens),
        ("CompletionRequest", "max_tokens", limits.max_new_tokens),
        ("ResponseRequest", "max_output_tokens", limits.max_new_tokens),
    ]


_ERROR_DESCRIPTIONS = {
    400: "Invalid request: the message says what is wrong (validation errors included)",
    401: "Missing or invalid API key",
    404: "No such document, job, session or model (another tenant's ids included)",
    409: "The chat session is answering another request (documents: another document holds this text)",
    413: "The request body (or document metadata) is too large",
    415: "Unsupported content type (an upload: a file type not served, or not the text its name says)",
    422: "An uploaded file of a served type that holds no text or cannot be read as that type",
    429: "The API key is past its request rate or its requests in progress: retry after Retry-After seconds",
    503: "The model worker is overloaded or stopping: retry after Retry-After seconds",
}


def errors(*statuses: int) -> dict[int | str, dict]:
    """`responses=` entries for these error statuses, each with the body actually sent."""
    return {status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "description": "one server-sent event",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "a JSON object; the last event is [DONE]"},
    },
}


def sse_or(model: type, description: str) -> dict[int | str, dict]:
    """A 200 that is JSON, or server-sent events with `stream: true`."""
    return {200: {"model": model, "description": description, "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def _error_response() -> dict:
    return {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _cap(schema: dict, model: str, field: str, maximum: int) -> None:
    """Document a limit the server config sets (the route refuses more with 400)."""
    prop = schema.get(model, {}).get("properties", {}).get(field)
    if prop is None:
        return
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch["maximum"] = maximum
    if isinstance(prop.get("default"), int) and prop["default"] > maximum:
        prop["default"] = maximum  # a default above the cap is lowered to it (api.common.conversion.sent_or_capped)


_KEYWORDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_keywords(node) -> None:
    """Pydantic writes a bound on an optional field whose type has its own validator
    (`Integer | None`) under its Python name (`ge`), which JSON Schema does not know: the
    generators then send values the route refuses. Renamed in place, everywhere."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for python, standard in _KEYWORDS.items():
                if python in node:
                    node.setdefault(standard, node.pop(python))
        for value in node.values():
            _standard_keywords(value)
    elif isinstance(node, list):
        for value in node:
            _standard_keywords(value)


def _cap_token_ids(node, vocabulary: int) -> None:
    """Every integer in a prompt's schema is a token id: below the vocabulary's size."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = vocabulary - 1
        for value in node.values():
            _cap_token_ids(value, vocabulary)
    elif isinstance(node, list):
        for value in node:
            _cap_token_ids(value, vocabulary)


def _fastapi_422(response: dict) -> bool:
    return "HTTPValidationError" in str(response)


def build_openapi(app: FastAPI, limits: ServeConfig, vocabulary: int | None = None) -> dict:
    """`vocabulary`: the served model's (token ids in prompts are below it); None before it loaded."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    _standard_keywords(schema)
    for model, field, maximum in capped_fields(limits):
        _cap(schemas, model, field, maximum)
    if vocabulary is not None:
        _cap_token_ids(schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt"), vocabulary)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for model in (ErrorResponse, DocumentCreate):  # bodies the routes read themselves
        model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(model_schema.pop("$defs", {}))
        schemas.setdefault(model.__name__, model_schema)
    components["securitySchemes"] = {
        SECURITY_SCHEME: {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key from --api-keys / $RAGKV_API_KEYS; not needed when the server has none",
        }
    }
    for path, operations in schema.get("paths", {}).items():
        for _method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            if _fastapi_422(responses.get("422", {})):
                responses.pop("422")  # validation errors are 400
            if path.startswith(PROTECTED_PREFIX):
                operation["security"] = [{SECURITY_SCHEME: []}]
                responses.setdefault("401", {"description": _ERROR_DESCRIPTIONS[401], **_error_response()})
                responses.setdefault("429", {"description": _ERROR_DESCRIPTIONS[429], **_error_response()})
            if "requestBody" in operation:
                responses.setdefault("400", {"description": _ERROR_DESCRIPTIONS[400], **_error_response()})
                responses.setdefault("413", {"description": _ERROR_DESCRIPTIONS[413], **_error_response()})
    app.openapi_schema = schema
    return schema


def install_docs(app: FastAPI, limits: ServeConfig) -> None:
    """/openapi.json and an offline Swagger UI at /docs (create the app with docs_url=None)."""

    def vocabulary() -> int | None:
        state = getattr(app.state, "ragkv", None)
        return state.client.vocabulary_size if state is not None else None

    app.openapi = lambda: build_openapi(app, limits, vocabulary())

    @app.get(f"{ASSETS_PATH}/swagger-ui-bundle.js", include_in_schema=False)
    def swagger_bundle() -> Response:
        return Response(
            SWAGGER_BUNDLE_GZ.read_bytes(),
            media_type="application/javascript",
            headers={"Content-Encoding": "gzip", "Cache-Control": "public, max-age=86400"},
        )

    app.mount(ASSETS_PATH, StaticFiles(directory=SWAGGER_ASSETS), name="swagger-ui-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title=f"{app.title} API",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon-32x32.png",
            swagger_ui_parameters={"persistAuthorization": True},
        )
