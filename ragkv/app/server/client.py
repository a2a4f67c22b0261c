"""The engine client: one entry for every front end over the one model.

It assembles what serving needs (the Runtime's store, registry and engine; the sessions;
the scheduler with its live fidelity sampling; the model worker and what it runs) and
runs the worker's loop on the thread that built the engine (ModelWorker.run explains why
one thread). A front end calls its methods: questions, chat turns and completions come
back submitted as a `RequestStream` to await, ingestion, deletion and embeddings as a
`Task` whose result is typed (IngestedDocument, DocumentRecord, Embeddings); reads
(documents, jobs, sessions, health, stats) answer at once. A full queue raises QueueFull.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence

from ragkv.app.chat.contexts import Context, ContextStore
from ragkv.app.chat.session_store import open_sessions, session_mac_key, sessions_url
from ragkv.app.chat.turn import ChatTurn
from ragkv.app.errors import QueueFull
from ragkv.app.ingest_records import FAILED, IngestRecord, IngestRecords
from ragkv.app.ingestion import DocumentRecord
from ragkv.app.live_fidelity import LiveFidelity, LiveFidelityConfig
from ragkv.app.rag import QueryConfig
from ragkv.app.request import RequestOutput
from ragkv.app.request_types import FusionConfig, GenerationConfig
from ragkv.app.runtime import Runtime
from ragkv.app.scheduler import Scheduler, SchedulerConfig
from ragkv.app.server import documents
from ragkv.app.server.config import MIB, ServerConfig
from ragkv.app.server.documents import Ingestion, JobReport
from ragkv.app.server.model_work import ModelWork
from ragkv.app.server.observer import ServerObserver
from ragkv.app.server.prefetch import Prefetcher
from ragkv.app.server.publication import settle_shared
from ragkv.app.server.request_stream import RequestStream
from ragkv.app.server.status import Backends, ServerHealth, ServerStats, scheduler_load, worker_load
from ragkv.app.server.task import Task
from ragkv.app.server.worker import ModelWorker
from ragkv.app.status import DefaultFusion


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


def _scheduler(runtime: Runtime, config: ServerConfig, observer: ServerObserver, prefetch: Prefetcher) -> Scheduler:
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
        max_running=config.max_active,
        max_waiting=config.max_queued,
        token_budget=config.token_budget,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    return Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids, bounds, fidelity, prefetch)


class EngineClient:
    """Built on the thread that will run the model (see `start`)."""

    def __init__(
        self, config: ServerConfig = ServerConfig(), observer: ServerObserver | None = None, *, read_only: bool = False
    ):
        """`read_only`: a front end that only answers (`ragkv ask`) creates and writes
        nothing in the data folder (Runtime's read_only); it cannot ingest."""
        self.config = config
        self.observer = observer or ServerObserver()
        self._runtime = Runtime(config.runtime, read_only=read_only)
        self._prefetch = Prefetcher(int(config.prefetch_mb * MIB))
        """Runs the requests' retrieval and store reads ahead of the model thread."""
        try:
            self._sessions = _open_sessions(config)
            self._worker = ModelWorker(
                _scheduler(self._runtime, config, self.observer, self._prefetch),
                max_active=config.max_active,
                max_queued=config.max_queued,
                on_finished=self.observer.task_ended,
            )
            self._prefetch.on_ready = self._worker.wake
            self._work = ModelWork(self._runtime, self._sessions, config.max_input_tokens, self.observer)
            self._ingest_records = None if read_only else IngestRecords(self._runtime.env)
        except BaseException:
            self._prefetch.close()
            self._runtime.close()
            raise
        self.model_id = config.model_id or self._runtime.engine.model_name
        """The name the model is served under."""

    @classmethod
    async def start(
        cls, config: ServerConfig, observer: ServerObserver | None = None, *, read_only: bool = False
    ) -> EngineClient:
        """Build the client on a new thread that then runs the model worker's loop: every
        torch op of the server runs on that one thread."""
        built: concurrent.futures.Future[EngineClient] = concurrent.futures.Future()

        def model_thread() -> None:
            try:
                client = cls(config, observer, read_only=read_only)
            except BaseException as error:
                built.set_exception(error)
                return
            built.set_result(client)
            client._worker.run()

        threading.Thread(target=model_thread, name="ragkv-model-worker", daemon=True).start()
        return await asyncio.wrap_future(built)

    async def stop(self) -> None:
        """Stop the worker (queued and running work is cancelled), then close everything."""
        await asyncio.to_thread(self._worker.stop)
        self.close()

    def close(self) -> None:
        self._prefetch.close()
        self._sessions.close()
        self._runtime.close()  # the writes queued behind reach the store first

    # -- generation: submitted streams of scheduler requests ---------------------------

    def query(self, question: str, tenant: str, config: QueryConfig) -> RequestStream:
        """A RAG question: retrieved, fused and answered with citations."""
        return self._worker.submit_requests(self._work.query_stream(question, tenant, config))

    def chat(self, turn: ChatTurn, context_id: str) -> RequestStream:
        """A chat turn; its context is kept under `context_id` (see `settle_shared`)."""
        return self._worker.submit_requests(self._work.chat_stream(turn, context_id))

    def complete(
        self,
        prompts: Sequence[str | list[int]],
        generation: GenerationConfig,
        tenant: str = "default",
        fusion: FusionConfig | None = None,
        prompt_spans: bool = False,
    ) -> RequestStream:
        """Plain completions, one request per prompt (see ModelWork.completion_stream)."""
        return self._worker.submit_requests(
            self._work.completion_stream(prompts, generation, tenant, fusion, prompt_spans)
        )

    # -- prompts as the requests above prefill them (answered at once, no model work) ----

    def render_chat(self, turn: ChatTurn) -> list[int]:
        """The ids `chat(turn)` prefills when nothing is retrieved (ChatTurns.conversation);
        checked as the turn would be. Retrieved chunks are not in them: retrieval embeds the
        question (model work) and reads the store."""
        return self._work.chat.conversation(turn).token_ids

    def render_question(self, question: str, config: QueryConfig) -> list[int]:
        """The ids `query(question, ...)` prefills around its retrieved chunks (none of them)."""
        return self._work.question_ids(question, config)

    def render_prompts(self, prompts: Sequence[str | list[int]], generation: GenerationConfig) -> list[list[int]]:
        """The ids `complete(prompts, generation)` prefills, one list per prompt."""
        return self._work.prompt_ids(prompts, generation)

    async def settle_shared(self, tenant: str, context_id: str, outcome: RequestOutput) -> None:
        """Await, at most `shared_publish_wait_s`, the turn's context reaching the shared
        session store, so a follow-up to any replica continues it (app.server.publication)."""
        await settle_shared(self._sessions, tenant, context_id, outcome, self.config.shared_publish_wait_s)

    def embed(self, texts: list[str]) -> Task:
        """Submitted; its result is the texts' Embeddings."""
        return self._worker.submit(Task("embedding", self._work.embeddings_body(texts)))

    @property
    def vocabulary_size(self) -> int:
        """Token ids of the served model are below it."""
        return self._runtime.engine.spec.vocab_size

    @property
    def embedding_dimension(self) -> int:
        return self._runtime.embedder.dimension

    def default_fusion(self) -> DefaultFusion:
        return self._runtime.default_fusion()

    # -- documents ----------------------------------------------------------------------

    def documents(self, tenant: str) -> list[DocumentRecord]:
        """The tenant's documents, oldest first."""
        return self._runtime.registry.list(tenant)

    def document(self, tenant: str, doc_id: str) -> DocumentRecord:
        """NotFoundError when the tenant has no such document."""
        return self._runtime.registry.get(tenant, doc_id)

    def document_text(self, tenant: str, doc_id: str) -> str:
        return self._runtime.registry.text(tenant, doc_id)

    @property
    def max_document_bytes(self) -> int:
        return self.config.runtime.ingest.max_document_bytes

    def new_document(
        self,
        tenant: str,
        text: str,
        name: str,
        metadata: dict | None = None,
        pages: list[list[int]] | None = None,
        replace_same_name: bool = False,
    ) -> Ingestion:
        """A document to add; with `replace_same_name`, it replaces the tenant's newest
        document of that name (keeping its id) when there is one."""
        replaces = documents.newest_named(self._runtime.registry, tenant, name) if replace_same_name else None
        return Ingestion(tenant, text, name, metadata, pages, replaces)

    def new_version(
        self, old: DocumentRecord, text: str, name: str | None, metadata: dict | None, pages: list[list[int]] | None
    ) -> Ingestion:
        """A new version of `old`, same id (app.server.documents.new_version)."""
        return documents.new_version(self._runtime.registry, old, text, name, metadata, pages)

    def ingest(self, ingestion: Ingestion, progress: Callable[[int, int], None] | None = None) -> Task:
        """Submitted as background work (interactive requests step first); its result is an
        IngestedDocument. `progress(chunks done, chunks)` is called on the worker thread."""
        body = self._work.ingest_body(ingestion, progress=progress)
        return self._worker.submit(Task("ingest", body, interactive=False))

    def ingest_job(self, ingestion: Ingestion, report: JobReport) -> IngestRecord:
        """Ingest in the background, nobody awaiting: the record (`job`, `jobs`) follows
        its progress and keeps its end as `report` writes it."""
        records = self._ingest_records
        record = records.create(ingestion.tenant, "ingest", ingestion.name)
        body = self._work.ingest_body(ingestion, progress=lambda done, total: records.progress(record, done, total))
        try:
            self._worker.submit(Task("ingest", documents.tracked(records, record, body, report), interactive=False))
        except QueueFull:
            records.finish(record, FAILED, error={"code": "queue_full", "message": "the server is busy"})
            raise
        return record

    def delete_document(self, tenant: str, doc_id: str) -> Task:
        """Submitted; its result is the deleted document's DocumentRecord."""
        return self._worker.submit(Task("delete", self._work.delete_body(doc_id, tenant)))

    def jobs(self, tenant: str) -> list[IngestRecord]:
        return self._ingest_records.list(tenant)

    def job(self, tenant: str, job_id: str) -> IngestRecord | None:
        return self._ingest_records.get(tenant, job_id)

    # -- sessions -------------------------------------------------------------------------

    def sessions_of(self, tenant: str) -> list[Context]:
        """The tenant's sessions held in this process's memory."""
        return self._sessions.list(tenant)

    def delete_session(self, tenant: str, session_id: str) -> bool:
        """False when there is no such session."""
        return self._sessions.delete(tenant, session_id)

    # -- status ---------------------------------------------------------------------------

    @property
    def backends(self) -> Backends:
        return Backends(self._runtime.store.backend, self._runtime.registry.backend, self._sessions.backend)

    def health(self) -> ServerHealth:
        """Pings Redis (blocking: call from a thread)."""
        return ServerHealth(
            backends=self.backends,
            store=self._runtime.store_status(),
            registry_up=self._runtime.registry.healthy(),
            sessions_up=self._sessions.healthy(),
            worker=worker_load(self._worker),
            fingerprint=self._runtime.engine.fingerprint,
        )

    def stats(self) -> ServerStats:
        """The figures metrics read when scraped; pings Redis (blocking: call from a thread)."""
        return ServerStats(
            backends=self.backends,
            store=self._runtime.store.stats(),
            store_redis_up=self._runtime.store_status().redis_up,
            prompt_spans=self._runtime.passages.counters.snapshot(),
            sessions=self._sessions.stats(),
            registry_up=self._runtime.registry.healthy(),
            ingest_jobs=self._ingest_records.counts(),
            worker=worker_load(self._worker),
            scheduler=scheduler_load(self._worker),
        )
