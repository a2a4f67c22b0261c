"""What the model worker runs for the routes: requests for the scheduler (queries, chat
turns, completions) and task bodies (ingestion, deletion, embeddings).

The query path and the chat-turn algorithm live in the application layer
(ragkv.app.query, ragkv.app.chat.turn); this module converts their errors to API errors and
records their metrics.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ragkv.api.config import ServeConfig
from ragkv.api.errors import as_api_error
from ragkv.api.metrics import Metrics
from ragkv.api.request_stream import RequestStream
from ragkv.api.task import Task
from ragkv.api.vllm_metrics import RequestRecord
from ragkv.app.chat.contexts import ContextStore
from ragkv.app.chat.turn import ChatInfo, ChatTurn, ChatTurns
from ragkv.app.completion import PassageRequest, completion_request, prompt_ids
from ragkv.app.query import QueryInfo, query_request
from ragkv.app.rag import QueryConfig
from ragkv.app.request import Request, RequestCancelled, RequestOutput
from ragkv.app.request_types import FusionConfig, GenerationConfig
from ragkv.app.runtime import Runtime
from ragkv.ingest.errors import InputError


class ModelWork:
    def __init__(self, runtime: Runtime, config: ServeConfig, metrics: Metrics, sessions: ContextStore):
        self.runtime = runtime
        self.rag = runtime.rag
        self.config = config
        self.metrics = metrics
        self.sessions = sessions
        runtime.passages.finder.prepare()  # at start-up (seconds for a large vocabulary), not on a request
        self.chat = ChatTurns(runtime.rag, sessions, config.max_input_tokens, passages=runtime.passages)

    # -- /v1/query ------------------------------------------------------------------

    def query_stream(self, question: str, tenant: str, config: QueryConfig) -> RequestStream:
        """A request the scheduler prepares and decodes (batched with the others)."""
        try:
            request = query_request(
                self.rag,
                question,
                tenant,
                config,
                max_input_tokens=self.config.max_input_tokens,
                arrival=time.perf_counter(),
                on_finished=self._record_query,
            )
        except InputError as error:
            raise as_api_error(error) from None
        return RequestStream("query", [request], self._count)

    # -- /v1/chat/completions -------------------------------------------------------

    def chat_stream(self, turn: ChatTurn, context_id: str) -> RequestStream:
        try:
            request = self.chat.request(
                turn, context_id=context_id, arrival=time.perf_counter(), on_finished=self._record_chat
            )
        except InputError as error:
            raise as_api_error(error) from None
        return RequestStream("chat", [request], self._count)

    # -- /v1/completions ------------------------------------------------------------

    def completion_stream(
        self,
        prompts: Sequence[str | list[int]],
        generation: GenerationConfig,
        tenant: str = "default",
        fusion: FusionConfig | None = None,
        prompt_spans: bool = False,
    ) -> RequestStream:
        """One request per prompt; every prompt is checked before any runs. `prompt_spans`:
        passages pasted into a prompt are reused from the store (fused by `fusion`)."""
        engine = self.runtime.engine
        try:
            all_ids = [
                prompt_ids(
                    engine,
                    prompt,
                    generation,
                    max_input_tokens=self.config.max_input_tokens,
                    where=f"prompt {index}" if len(prompts) > 1 else "the prompt",
                )
                for index, prompt in enumerate(prompts)
            ]
        except InputError as error:
            raise as_api_error(error) from None
        arrival = time.perf_counter()
        return RequestStream(
            "completion",
            [
                completion_request(
                    engine,
                    ids,
                    generation,
                    arrival=arrival,
                    on_finished=self._record_completion,
                    passages=PassageRequest(self.runtime.passages, tenant, fusion or FusionConfig())
                    if prompt_spans
                    else None,
                )
                for ids in all_ids
            ],
            self._count,
        )

    # -- metrics --------------------------------------------------------------------

    def _count(self, stream: RequestStream) -> None:
        self.metrics.jobs.labels(stream.kind, stream.outcome or "unknown").inc()

    def _record_query(self, request: Request, completion: RequestOutput) -> None:
        info: QueryInfo = completion.info
        self._record("query", "fused", request, completion)
        self.metrics.record_usage(
            completion.usage, max(len(completion.citations) - info.missing_chunks, 0), info.missing_chunks
        )

    def _record_chat(self, request: Request, completion: RequestOutput) -> None:
        info: ChatInfo = completion.info
        phase = "next_turn" if info.turn > 1 else "first_turn"
        self._record("chat", phase, request, completion)
        self.metrics.record_usage(completion.usage, info.new_chunks, 0)
        self.metrics.sessions_turns.labels(phase).inc()

    def _record_completion(self, request: Request, completion: RequestOutput) -> None:
        """A plain completion: vLLM's request metrics only (ragkv's own families describe
        retrieval and sessions, which a plain completion has none of)."""
        self._record_vllm(request, completion)

    def _record(self, endpoint: str, phase: str, request: Request, completion: RequestOutput) -> None:
        self.metrics.ttft.labels(endpoint, phase).observe(completion.timings.ttft)
        self.metrics.queue_wait.labels(endpoint).observe(completion.timings.queue)
        self._record_vllm(request, completion)

    def _record_vllm(self, request: Request, completion: RequestOutput) -> None:
        self.metrics.vllm.record_request(self.metrics.model_name, RequestRecord.of(request, completion))

    # -- ingestion and deletion -----------------------------------------------------

    def ingest_body(
        self,
        text: str,
        name: str,
        tenant: str,
        metadata: dict | None,
        progress=None,
        pages: list[list[int]] | None = None,
        replaces: str | None = None,
    ):
        """An ingestion as a task body: one step per batch of chunk encodes, so the worker
        loop runs the requests' decode steps between them (a cancelled task is closed
        between two steps, which rolls back what it wrote)."""

        def body(task: Task):
            result = yield from self.runtime.ingestor.ingest_steps(
                text, name, tenant=tenant, metadata=metadata, progress=progress, pages=pages, replaces=replaces
            )
            # chunks that carry context (--context-neighbours): one chunk's recompute per step
            try:
                yield from self.runtime.contextualize_steps(tenant, [result.doc_id])
            except RequestCancelled:
                pass  # the document is in; its chunks keep the K/V ingestion stored
            return result

        return body

    def embeddings_body(self, texts: list[str]):
        """(vectors [n, dimension] float32 unit rows, tokens read) for the texts."""
        embedder = self.runtime.embedder

        def body(task: Task):
            tokenizer = embedder.model.tokenizer
            tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"])
            vectors = np.asarray(embedder.embed_passages(texts), dtype=np.float32)
            return vectors, tokens
            yield  # a generator: embedding is one step

        return body

    def delete_body(self, doc_id: str, tenant: str):
        def body(task: Task):
            return self.runtime.ingestor.delete(doc_id, tenant)
            yield

        return body
