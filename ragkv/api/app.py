"""The FastAPI application: `create_app(ServeConfig)`; `ragkv serve` runs it under uvicorn.

Startup (lifespan) starts the engine client (ragkv.app.server: store, registry, engine,
sessions, the model worker) on its model thread; shutdown stops it (queued and running
work is cancelled) and closes everything.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ragkv.api.access_log import AccessLogMiddleware
from ragkv.api.auth import Authenticator, load_api_keys, load_key_limits, load_store_budgets
from ragkv.api.config import ServeConfig
from ragkv.api.errors import install_error_handlers
from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.metrics import Metrics, MetricsObserver, scrape_readings
from ragkv.api.middleware import ServingMiddleware
from ragkv.api.openapi import install_docs
from ragkv.api.rate_limits import KeyLimiter
from ragkv.api.routers import ROUTERS
from ragkv.api.state import AppState
from ragkv.api.web_page import install_web
from ragkv.app.server import EngineClient

log = logging.getLogger("ragkv.api")


def create_app(config: ServeConfig = ServeConfig()) -> FastAPI:
    metrics = Metrics()
    config = config.with_store_budgets(load_store_budgets(config.api_keys_file))
    authenticator = Authenticator(
        load_api_keys(config.api_keys_file), load_key_limits(config.api_keys_file, config.key_limits), config.key_limits
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = await EngineClient.start(config, MetricsObserver(metrics))
        metrics.model_name = client.model_id
        metrics.vllm.declare(client.model_id)
        state = AppState(config, client, metrics)
        metrics.add_scrape_time(lambda: scrape_readings(state))
        app.state.ragkv = state
        tenants = ", ".join(sorted(authenticator.tenants)) if authenticator.enabled else "default (no API keys)"
        backends = client.backends
        log.info(
            f"serving {state.model_id} on http://{config.host}:{config.port}; store {backends.store}, "
            f"registry {backends.registry}, sessions {backends.sessions}, tenants {tenants}"
        )
        try:
            yield
        finally:
            await client.stop()

    app = FastAPI(
        title="ragkv",
        version="0.1.0",
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
        docs_url=None,
        redoc_url=None,
        description="RAG serving over precomputed chunk KV caches: documents, questions, OpenAI-compatible chat.",
    )
    app.state.authenticator = authenticator
    install_error_handlers(app)
    install_docs(app, config)
    install_web(app)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(
        ServingMiddleware,
        metrics=metrics,
        authenticator=authenticator,
        limiter=KeyLimiter(config.rate_limit_storage),
        max_body_bytes=int(config.max_body_kb * 1024),
        max_document_body_bytes=int(config.max_document_body_mb * (1 << 20)),
    )
    if config.access_log:
        app.add_middleware(AccessLogMiddleware)  # outermost: sees the request id and tenant set inside
    return app
