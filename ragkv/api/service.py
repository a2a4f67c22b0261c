"""What the model worker runs for the routes: requests for the scheduler (queries, chat
turns) and job bodies (ingestion, deletion).

The query path and the chat-turn algorithm live in the application layer
(ragkv.app.query, ragkv.app.chat); this module converts their errors to API errors and
records their metrics.
"""

from __future__ import annotations

import time

from ragkv.api.config import ServeConfig
from ragkv.api.errors import as_api_error
from ragkv.api.metrics import Metrics
from ragkv.api.sessions import RedisSessions
from ragkv.api.vllm_metrics import RequestRecord
from ragkv.api.worker import Job
from ragkv.app.chat import ChatTurn, ChatTurns
from ragkv.app.contexts import ContextCache
from ragkv.app.query import query_request
from ragkv.app.rag import QueryConfig
from ragkv.app.request import Completion, Request
from ragkv.app.runtime import Runtime
from ragkv.ingest.errors import InputError


class Service:
    def __init__(self, runtime: Runtime, config: ServeConfig, metrics: Metrics, sessions: ContextCache | RedisSessions):
        self.runtime = runtime
        self.rag = runtime.rag
        self.config = config
        self.metrics = metrics
        self.sessions = sessions
        self.chat = ChatTurns(runtime.rag, sessions, config.max_input_tokens)

    # -- /v1/query ------------------------------------------------------------------

    def query_job(self, question: str, tenant: str, config: QueryConfig) -> Job:
        """A job whose request the scheduler prepares and decodes (batched with the others)."""
        try:
            request = query_request(self.rag, question, tenant, config, max_input_tokens=self.config.max_input_tokens,
                                    arrival=time.perf_counter(), on_finished=self._recorder("query"))
        except InputError as error:
            raise as_api_error(error) from None
        return Job("query", request=request)

    # -- /v1/chat/completions -------------------------------------------------------

    def chat_job(self, turn: ChatTurn, context_id: str) -> Job:
        try:
            request = self.chat.request(turn, context_id=context_id, arrival=time.perf_counter(),
                                        on_finished=self._recorder("chat"))
        except InputError as error:
            raise as_api_error(error) from None
        return Job("chat", request=request)

    def _recorder(self, endpoint: str):
        def record(request: Request, completion: Completion) -> None:
            phase = "fused" if endpoint == "query" else ("next_turn" if completion.info["turn"] > 1 else "first_turn")
            self.metrics.ttft.labels(endpoint, phase).observe(completion.timings.ttft)
            self.metrics.queue_wait.labels(endpoint).observe(completion.timings.queue)
            missing = completion.info.get("missing_chunks", 0)
            fused = completion.info.get("new_chunks", len(completion.citations))
            self.metrics.record_usage(completion.usage, max(fused - missing, 0), missing)
            if endpoint == "chat":
                self.metrics.sessions_turns.labels(phase).inc()
            self.metrics.vllm.record_request(self.metrics.model_name, RequestRecord.of(request, completion))

        return record

    # -- ingestion and deletion -----------------------------------------------------

    def ingest_body(self, text: str, name: str, tenant: str, metadata: dict | None, progress=None, checkpoint=None):
        def body(job: Job):
            def on_progress(done: int, total: int) -> None:
                if progress is not None:
                    progress(done, total)
                job.check_cancelled()
                if checkpoint is not None:
                    checkpoint()
                job.check_cancelled()

            result = self.runtime.ingestor.ingest_text(text, name, tenant=tenant, metadata=metadata, progress=on_progress)
            return result
            yield  # a generator: the whole ingestion is one step (it yields to queries via checkpoint)

        return body

    def delete_body(self, doc_id: str, tenant: str):
        def body(job: Job):
            return self.runtime.ingestor.delete(doc_id, tenant)
            yield

        return body
