"""The engine client: one entry for every front end over the one model.

It assembles what serving needs (the Runtime's store, registry and engine; the sessions;
the scheduler with its live fidelity sampling; the model worker and what it runs) and
runs the worker's loop on the thread that built the engine (ModelWorker.run explains why
one thread). A front end submits work and awaits typed events: a `RequestStream` for
questions, chat turns and completions, a `Task` for ingestion, deletion and embeddings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from ragkv.app.chat.contexts import ContextStore
from ragkv.app.chat.session_store import open_sessions, session_mac_key, sessions_url
from ragkv.app.ingest_records import IngestRecords
from ragkv.app.live_fidelity import LiveFidelity, LiveFidelityConfig
from ragkv.app.runtime import Runtime
from ragkv.app.scheduler import Scheduler, SchedulerConfig
from ragkv.app.server.config import MIB, ServerConfig
from ragkv.app.server.model_work import ModelWork
from ragkv.app.server.observer import ServerObserver
from ragkv.app.server.worker import ModelWorker


def _open_sessions(config: ServerConfig) -> ContextStore:
    return open_sessions(
        sessions_url(config.session_store, config.runtime.store_url),
        int(config.session_memory_mb * MIB),
        int(config.anonymous_memory_mb * MIB),
        config.session_ttl_s,
        config.session_lock_ttl_s,
        shared_bytes=int(config.shared_context_mb * MIB),
        shared_codes=config.shared_context_codes,
        mac_key=session_mac_key(config.runtime.store_secret),
    )


def _scheduler(runtime: Runtime, config: ServerConfig, observer: ServerObserver) -> Scheduler:
    engine = runtime.engine
    fidelity = (
        LiveFidelity(
            LiveFidelityConfig(rate=config.fidelity_sample_rate),
            on_measured=observer.fidelity_measured,
            on_dropped=observer.fidelity_dropped,
        )
        if config.fidelity_sample_rate
        else None
    )
    bounds = SchedulerConfig(
        max_running=config.max_active, max_waiting=config.max_queued, token_budget=config.token_budget
    )
    return Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids, bounds, fidelity)


class EngineClient:
    """Built on the thread that will run the model (see `start`)."""

    def __init__(self, config: ServerConfig = ServerConfig(), observer: ServerObserver | None = None):
        self.config = config
        self.observer = observer or ServerObserver()
        self.runtime = Runtime(config.runtime)
        try:
            self.sessions = _open_sessions(config)
            self.worker = ModelWorker(
                _scheduler(self.runtime, config, self.observer),
                max_active=config.max_active,
                max_queued=config.max_queued,
                on_finished=self.observer.task_ended,
            )
            self.work = ModelWork(self.runtime, self.sessions, config.max_input_tokens, self.observer)
            self.ingest_records = IngestRecords(self.runtime.env)
        except BaseException:
            self.runtime.close()
            raise
        self.model_id = config.model_id or self.runtime.engine.model_name
        """The name the model is served under."""

    @classmethod
    async def start(cls, config: ServerConfig, observer: ServerObserver | None = None) -> EngineClient:
        """Build the client on a new thread that then runs the model worker's loop: every
        torch op of the server runs on that one thread."""
        built: concurrent.futures.Future[EngineClient] = concurrent.futures.Future()

        def model_thread() -> None:
            try:
                client = cls(config, observer)
            except BaseException as error:
                built.set_exception(error)
                return
            built.set_result(client)
            client.worker.run()

        threading.Thread(target=model_thread, name="ragkv-model-worker", daemon=True).start()
        return await asyncio.wrap_future(built)

    async def stop(self) -> None:
        """Stop the worker (queued and running work is cancelled), then close everything."""
        await asyncio.to_thread(self.worker.stop)
        self.close()

    def close(self) -> None:
        self.sessions.close()
        self.runtime.close()
