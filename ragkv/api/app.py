"""The FastAPI application: `create_app(ServeConfig)`; `ragkv serve` runs it under uvicorn.

Startup (lifespan) opens the Runtime (store, registry, engine, embedder) in a thread,
starts the model worker and opens the session store; shutdown stops the worker (queued
and running jobs are cancelled) and closes everything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ragkv.api.access_log import AccessLogMiddleware
from ragkv.api.auth import Authenticator, load_api_keys
from ragkv.api.config import ServeConfig
from ragkv.api.errors import install_error_handlers
from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.metrics import Metrics, scrape_readings
from ragkv.api.middleware import ServingMiddleware
from ragkv.api.model_work import ModelWork
from ragkv.api.openapi import install_docs
from ragkv.api.routers import ROUTERS
from ragkv.api.state import AppState
from ragkv.api.web_page import install_web
from ragkv.api.worker import ModelWorker
from ragkv.app.chat.session_store import open_sessions, session_mac_key, sessions_url
from ragkv.app.ingest_records import IngestRecords
from ragkv.app.live_fidelity import LiveFidelity, LiveFidelityConfig
from ragkv.app.runtime import Runtime
from ragkv.app.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("ragkv.api")


def _build_state(config: ServeConfig, metrics: Metrics) -> AppState:
    runtime = Runtime(config.runtime)
    try:
        session_url = sessions_url(config.session_store, config.runtime.store_url)
        sessions = open_sessions(
            session_url,
            int(config.session_memory_mb * (1 << 20)),
            int(config.anonymous_memory_mb * (1 << 20)),
            config.session_ttl_s,
            config.session_lock_ttl_s,
            shared_bytes=int(config.shared_context_mb * (1 << 20)),
            shared_codes=config.shared_context_codes,
            mac_key=session_mac_key(config.runtime.store_secret),
        )
        engine = runtime.engine
        scheduler = Scheduler(
            engine.model,
            engine.tokenizer,
            engine.eos_token_ids,
            SchedulerConfig(
                max_running=config.max_active, max_waiting=config.max_queued, token_budget=config.token_budget
            ),
            LiveFidelity(
                LiveFidelityConfig(rate=config.fidelity_sample_rate),
                on_measured=metrics.record_fidelity,
                on_dropped=metrics.fidelity_dropped.inc,
            )
            if config.fidelity_sample_rate
            else None,
        )
        worker = ModelWorker(
            scheduler,
            max_active=config.max_active,
            max_queued=config.max_queued,
            on_finished=lambda task: metrics.jobs.labels(task.kind, task.outcome or "unknown").inc(),
        )
        work = ModelWork(runtime, config, metrics, sessions)
        model_id = config.model_id or runtime.engine.model_name
        metrics.model_name = model_id
        metrics.vllm.declare(model_id)
        state = AppState(config, runtime, worker, sessions, IngestRecords(runtime.env), metrics, work, model_id)
    except BaseException:
        runtime.close()
        raise
    return state


async def _start_model_thread(config: ServeConfig, metrics: Metrics) -> AppState:
    """Build the state on a new thread that then runs the model worker loop: every torch
    op of the server runs on that one thread (see ModelWorker.run)."""
    built: concurrent.futures.Future[AppState] = concurrent.futures.Future()

    def model_thread() -> None:
        try:
            state = _build_state(config, metrics)
        except BaseException as error:
            built.set_exception(error)
            return
        built.set_result(state)
        state.worker.run()

    threading.Thread(target=model_thread, name="ragkv-model-worker", daemon=True).start()
    return await asyncio.wrap_future(built)


def create_app(config: ServeConfig = ServeConfig()) -> FastAPI:
    metrics = Metrics()
    authenticator = Authenticator(load_api_keys(config.api_keys_file))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = await _start_model_thread(config, metrics)
        metrics.add_scrape_time(lambda: scrape_readings(state))
        app.state.ragkv = state
        tenants = ", ".join(sorted(authenticator.tenants)) if authenticator.enabled else "default (no API keys)"
        log.info(
            f"serving {state.model_id} on http://{config.host}:{config.port}; store {state.runtime.store.backend}, "
            f"registry {state.runtime.registry.backend}, sessions {state.sessions.backend}, tenants {tenants}"
        )
        try:
            yield
        finally:
            await asyncio.to_thread(state.worker.stop)
            state.sessions.close()
            state.runtime.close()

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
        max_body_bytes=int(config.max_body_kb * 1024),
        max_document_body_bytes=int(config.max_document_body_mb * (1 << 20)),
    )
    if config.access_log:
        app.add_middleware(AccessLogMiddleware)  # outermost: sees the request id and tenant set inside
    return app
