"""One log line per HTTP request on the `ragkv.access` logger: method, path, status,
latency, request id and tenant (the fields also ride on the record, so `--log-format json`
writes them as JSON keys).

It wraps the serving middleware, so the request id and tenant that middleware assigned
are known when the response is done; uvicorn's own access log (which knows neither) is
off.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("ragkv.access")


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}  # what the client sees if the app fails before responding

        async def send_with_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            state = scope.get("state", {})
            fields = {
                "method": scope.get("method", ""),
                "path": scope.get("path", ""),
                "status": status["code"],
                "latency_ms": round((time.perf_counter() - started) * 1000, 1),
                "request_id": state.get("request_id", "-"),
                "tenant": state.get("tenant", "-"),
                "client": (scope.get("client") or ("-",))[0],
            }
            log.info(
                "%(method)s %(path)s %(status)d %(latency_ms).1fms %(request_id)s tenant=%(tenant)s client=%(client)s",
                fields,
                extra=fields,
            )
