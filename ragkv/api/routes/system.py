"""GET /health and GET /metrics (both open: no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ragkv.api.state import app_state

router = APIRouter(tags=["system"])


@router.api_route("/health", methods=["GET", "HEAD"])
def health(request: Request):
    """200 with status "ok" or "degraded" (answering, with a fallback in use: Redis gone),
    503 "unavailable" when the model worker has stopped."""
    report = app_state(request).health()
    return JSONResponse(report, status_code=503 if report["status"] == "unavailable" else 200)


@router.get("/metrics")
def metrics(request: Request):
    return Response(generate_latest(app_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
