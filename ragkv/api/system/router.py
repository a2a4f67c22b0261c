"""GET /health and GET /metrics (both open: no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.state import app_state
from ragkv.api.system.protocol import Health
from ragkv.api.system.serving import health as health_of

router = APIRouter(tags=["system"], default_response_class=SafeJSONResponse)


@router.get(
    "/health",
    response_model=Health,
    responses={
        200: {"model": Health, "description": "ok or degraded"},
        503: {"model": Health, "description": "unavailable: the model worker has stopped"},
    },
)
@router.head("/health", include_in_schema=False)
def health(request: Request, response: Response):
    """200 with status "ok" or "degraded" (answering, with a fallback in use: Redis gone),
    503 "unavailable" when the model worker has stopped."""
    report = health_of(app_state(request))
    if report.status == "unavailable":
        response.status_code = 503
    return report


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format",
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
        }
    },
)
def metrics(request: Request):
    """Prometheus metrics: requests, latency, TTFT, chunk hits, token reuse, store and sessions."""
    return Response(generate_latest(app_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
