"""One pure ASGI middleware: request ids, API keys, body size limits, request metrics,
and the 500 answer to an unexpected error.

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

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ragkv.api.auth import Authenticator
from ragkv.api.errors import ApiError, error_body
from ragkv.api.metrics import Metrics

log = logging.getLogger("ragkv.api")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body exceeds the limit of {limit} bytes")


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
    ):
        self.app = app
        self.metrics = metrics
        self.authenticator = authenticator
        self.protected_prefix = protected_prefix
        self.max_body_bytes = max_body_bytes
        self.max_document_body_bytes = max_document_body_bytes
        self.document_prefix = document_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else "req_" + uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        path = scope.get("path", "")
        limit = self.max_document_body_bytes if path.startswith(self.document_prefix) else self.max_body_bytes
        status = {"code": 500, "started": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", request_id.encode())]
            await send(message)

        try:
            if path.startswith(self.protected_prefix):
                try:
                    scope["state"]["tenant"] = self.authenticator.tenant_for(headers.get("authorization"))
                except ApiError as error:
                    await self._reject(
                        send_with_id,
                        error.status,
                        error.code,
                        error.message,
                        request_id,
                        [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()],
                    )
                    return
            declared = headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                message = (
                    f"the request body is {declared} bytes; the limit is {limit} bytes"
                    if declared.isdigit()
                    else "the Content-Length header is not a number"
                )
                code = 413 if declared.isdigit() else 400
                await self._reject(
                    send_with_id, code, "body_too_large" if code == 413 else "bad_content_length", message, request_id
                )
                return
            received = {"bytes": 0}

            async def limited_receive() -> Message:
                message = await receive()
                if message["type"] == "http.request":
                    received["bytes"] += len(message.get("body", b""))
                    if received["bytes"] > limit:
                        raise BodyTooLarge(limit)
                return message

            try:
                await self.app(scope, limited_receive, send_with_id)
            except Exception as error:
                if status["started"]:
                    raise
                log.error("request %s %s %s failed", request_id, scope.get("method"), path, exc_info=error)
                await self._reject(
                    send_with_id,
                    500,
                    "internal_error",
                    f"internal error; quote request id {request_id} to the operator",
                    request_id,
                )
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.requests.labels(label, method, str(status["code"])).inc()
            self.metrics.latency.labels(label, method).observe(time.perf_counter() - started)

    @staticmethod
    async def _reject(
        send: Send,
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
        await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
        await send({"type": "http.response.body", "body": body})
