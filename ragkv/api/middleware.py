"""One pure ASGI middleware: request ids, API keys, body size limits, each key's request
rate and concurrency (ragkv.api.rate_limits), request metrics, and the 500 answer to an
unexpected error.

Authentication happens here, before any body is read, for every /v1/ route: a request
without a valid key is refused before its body is parsed. /health and /metrics are open.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses pass through untouched and a
client disconnect reaches the endpoint.

An unexpected error is answered here rather than by Starlette's ServerErrorMiddleware,
which re-raises after answering and so makes uvicorn drop the keep-alive connection: the
client's next request on it would be reset. Only an error after the response started
(mid-stream) still ends the connection, as it must.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ragkv.api.auth import Authenticator
from ragkv.api.errors import ApiError, error_body
from ragkv.api.metrics import Metrics
from ragkv.api.rate_limits import KeyLimiter

log = logging.getLogger("ragkv.api")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, option: str):
        super().__init__(413, f"the request body exceeds the limit of {limit} bytes ({option})")


@dataclass(frozen=True)
class _Incoming:
    """What the middleware reads of a request before the app sees it."""

    id: str
    path: str
    headers: dict[str, str]
    """Lower-case names."""
    limit: int
    """Body bytes the path may send."""
    option: str
    """The server option that sets `limit`, named in the 413."""


class _Response:
    """The response side of one request: its messages carry the request id, and its status
    is kept for the metrics (500 until a response starts)."""

    def __init__(self, send: Send, request_id: str):
        self._send = send
        self.request_id = request_id
        self.status = 500
        self.started = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status, self.started = message["status"], True
            message.setdefault("headers", [])
            message["headers"] = list(message["headers"]) + [(b"x-request-id", self.request_id.encode())]
        await self._send(message)


class ServingMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        authenticator: Authenticator,
        max_body_bytes: int,
        max_document_body_bytes: int,
        document_prefix: str = "/v1/documents",
        protected_prefix: str = "/v1/",
        limiter: KeyLimiter | None = None,
    ):
        self.app = app
        self.metrics = metrics
        self.authenticator = authenticator
        self.limiter = limiter or KeyLimiter()
        self.protected_prefix = protected_prefix
        self.max_body_bytes = max_body_bytes
        self.max_document_body_bytes = max_document_body_bytes
        self.document_prefix = document_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request = self._incoming(scope)
        scope.setdefault("state", {})["request_id"] = request.id
        response = _Response(send, request.id)
        try:
            if await self._authenticate(scope, request, response) and await self._declared_size(request, response):
                caller = scope["state"].get("caller")
                refusal = self.limiter.admit(caller.key_id, caller.limits) if caller else None
                if refusal is not None:
                    await self._reject_error(response, refusal, request.id)
                elif caller is None:
                    await self._serve(scope, receive, request, response)
                else:
                    try:
                        await self._serve(scope, receive, request, response)
                    finally:
                        self.limiter.release(caller.key_id)
        finally:
            self._count(scope, response.status, started)

    def _incoming(self, scope: Scope) -> _Incoming:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else "req_" + uuid.uuid4().hex[:16]
        path = scope.get("path", "")
        if path.startswith(self.document_prefix):
            return _Incoming(request_id, path, headers, self.max_document_body_bytes, "--max-document-body-mb")
        return _Incoming(request_id, path, headers, self.max_body_bytes, "--max-body-kb")

    async def _authenticate(self, scope: Scope, request: _Incoming, response: _Response) -> bool:
        """The tenant of a protected path's key, in the scope's state; False once refused."""
        if not request.path.startswith(self.protected_prefix):
            return True
        try:
            caller = self.authenticator.caller_for(request.headers.get("authorization"))
        except ApiError as error:
            await self._reject_error(response, error, request.id)
            return False
        scope["state"]["tenant"], scope["state"]["caller"] = caller.tenant, caller
        return True

    async def _declared_size(self, request: _Incoming, response: _Response) -> bool:
        """False once a Content-Length over the limit (413) or not a number (400) is refused."""
        limit, declared = request.limit, request.headers.get("content-length")
        if declared is None or (declared.isdigit() and int(declared) <= limit):
            return True
        if declared.isdigit():
            code, message = 413, f"the request body is {declared} bytes; the limit is {limit} bytes ({request.option})"
        else:
            code, message = 400, "the Content-Length header is not a number"
        error = "body_too_large" if code == 413 else "bad_content_length"
        await self._reject(response, code, error, message, request.id)
        return False

    async def _serve(self, scope: Scope, receive: Receive, request: _Incoming, response: _Response) -> None:
        """The app, reading at most the limit's bytes of body; an unexpected error before the
        response started is answered with a 500 (after it started, it ends the connection)."""
        limit, received = request.limit, {"bytes": 0}

        async def limited_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                received["bytes"] += len(message.get("body", b""))
                if received["bytes"] > limit:
                    raise BodyTooLarge(limit, request.option)
            return message

        try:
            await self.app(scope, limited_receive, response.send)
        except Exception as error:
            if response.started:
                raise
            log.error("request %s %s %s failed", request.id, scope.get("method"), request.path, exc_info=error)
            message = f"internal error; quote request id {request.id} to the operator"
            await self._reject(response, 500, "internal_error", message, request.id)

    def _count(self, scope: Scope, status: int, started: float) -> None:
        route = scope.get("route")
        label = getattr(route, "path", None) or "unmatched"
        method = scope.get("method", "")
        self.metrics.requests.labels(label, method, str(status)).inc()
        self.metrics.latency.labels(label, method).observe(time.perf_counter() - started)

    @classmethod
    async def _reject_error(cls, response: _Response, error: ApiError, request_id: str) -> None:
        extra = [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
        await cls._reject(response, error.status, error.code, error.message, request_id, extra)

    @staticmethod
    async def _reject(
        response: _Response,
        status: int,
        code: str,
        message: str,
        request_id: str,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        body = json.dumps(error_body(status, code, message, request_id)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 413:
            headers.append((b"connection", b"close"))  # the unread body must not be parsed as the next request
        await response.send(
            {"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])}
        )
        await response.send({"type": "http.response.body", "body": body})
