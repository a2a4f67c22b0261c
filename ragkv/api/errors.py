"""Every failure becomes a JSON error in the OpenAI shape, never a traceback.

    {"error": {"message": "...", "type": "invalid_request_error", "code": "...", "param": null},
     "request_id": "..."}

Bad input is a 4xx with a message saying what is wrong; validation errors are 400, as
OpenAI and vLLM answer. Anything unexpected is logged server-side with its traceback and
answered 500 with only the request id, by the serving middleware (api.middleware) so the
keep-alive connection stays usable.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ragkv.api.json_response import SafeJSONResponse
from ragkv.app.errors import (
    InputError,
    NotFoundError,
    QueueFull,
    RegistryUnavailableError,
    RequestCancelled,
    SessionBusyError,
    SessionStoreUnavailableError,
    StoreUnavailableError,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An error with an HTTP status, a short code and a message for the client."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers


class ClientGone(RequestCancelled):
    """The client disconnected before its answer was ready (its work was cancelled)."""


class QueueFullError(ApiError):
    def __init__(self, queued: int):
        super().__init__(
            503,
            "overloaded",
            f"the model worker has {queued} requests waiting; retry shortly",
            headers={"Retry-After": "1"},
        )


def error_body(status: int, code: str, message: str, request_id: str | None, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"),
            "code": code,
            "param": param,
        },
        "request_id": request_id,
    }


def request_id_of(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


_UNAVAILABLE = {
    RegistryUnavailableError: ("registry_unavailable", "the document registry is unreachable; retry shortly"),
    StoreUnavailableError: ("store_unavailable", "the chunk store cannot take writes now; nothing was ingested"),
}
"""503s with a Retry-After: what cannot be reached, by error type (checked in this order)."""


_INPUT_STATUS = {"too_large": 413, "duplicate_text": 409, "binary": 422, "no_documents": 404}
"""InputError reasons that are not a 400: a body too large; no document to answer from (none
ingested, or none matches the filter: as for document ids that do not exist); a new version whose text another
document holds (a conflict with the tenant's documents, not a malformed request); a
document's text that is binary data (a string the schema takes, a content the server cannot
index)."""


def as_api_error(error: BaseException) -> ApiError | None:
    """The client-facing form of errors raised by ingestion, retrieval or the configs."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, QueueFull):
        return QueueFullError(error.waiting)
    if isinstance(error, NotFoundError):
        return ApiError(404, getattr(error, "code", "not_found"), str(error))
    if isinstance(error, SessionBusyError):
        return ApiError(409, "session_busy", str(error), param="session_id", headers={"Retry-After": "1"})
    if isinstance(error, SessionStoreUnavailableError):
        return ApiError(503, "session_store_unavailable", str(error), param="session_id", headers={"Retry-After": "1"})
    if isinstance(error, InputError):
        status = _INPUT_STATUS.get(error.reason, 400)
        return ApiError(status, error.reason, str(error))
    for kind, (code, what) in _UNAVAILABLE.items():
        if isinstance(error, kind):
            return ApiError(503, code, f"{what}: {error}", headers={"Retry-After": "5"})
    return None


_NOT_AN_OBJECT = ("model_type", "model_attributes_type", "dict_type", "missing")


def _describe_validation(error: RequestValidationError) -> tuple[int, str, str, str | None]:
    problems = error.errors()
    if any(problem.get("type") == "json_invalid" for problem in problems):
        problem = next(p for p in problems if p.get("type") == "json_invalid")
        detail = (problem.get("ctx") or {}).get("error", "")
        return 400, "malformed_json", f"the request body is not valid JSON{': ' + str(detail) if detail else ''}", None
    if any(tuple(p.get("loc", ())) == ("body",) and p.get("type") in _NOT_AN_OBJECT for p in problems):
        return 400, "invalid_parameters", "the request body must be a JSON object", None
    messages, param = [], None
    for problem in problems[:5]:
        location = [str(part) for part in problem.get("loc", ()) if part not in ("body", "query", "path", "header")]
        where = ".".join(location) or "body"
        param = param or (where if location else None)
        messages.append(f"{where}: {problem.get('msg', 'invalid')}")
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return 400, "invalid_parameters", "; ".join(messages) + more, param


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves on this path (Starlette's 405 names only the first
    matching route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> SafeJSONResponse:
        return SafeJSONResponse(
            error_body(error.status, error.code, error.message, request_id_of(request), error.param),
            status_code=error.status,
            headers=error.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> SafeJSONResponse:
        status, code, message, param = _describe_validation(error)
        return SafeJSONResponse(error_body(status, code, message, request_id_of(request), param), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> SafeJSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(error.status_code, "http_error")
        message = str(error.detail) if error.detail else "error"
        headers = getattr(error, "headers", None)
        if error.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        if error.status_code == 405:
            allowed = _allowed_methods(request)
            message = f"{request.method} is not allowed on {request.url.path}; use {', '.join(allowed)}"
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        return SafeJSONResponse(
            error_body(error.status_code, code, message, request_id_of(request)),
            status_code=error.status_code,
            headers=headers,
        )

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, error: QueueFull) -> SafeJSONResponse:
        return await _api_error(request, as_api_error(error))

    @app.exception_handler(InputError)
    async def _input(request: Request, error: InputError) -> SafeJSONResponse:
        return await _api_error(request, as_api_error(error))

    @app.exception_handler(NotFoundError)
    async def _not_found(request: Request, error: NotFoundError) -> SafeJSONResponse:
        return await _api_error(request, as_api_error(error))

    @app.exception_handler(RegistryUnavailableError)
    async def _registry_down(request: Request, error: RegistryUnavailableError) -> SafeJSONResponse:
        return await _api_error(request, as_api_error(error))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, error: ClientGone) -> Response:
        # Nobody reads this; 499 (nginx's "client closed request") keeps the metrics honest.
        return Response(status_code=499)
