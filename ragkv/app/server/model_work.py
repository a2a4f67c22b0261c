"""What the model worker runs for the front ends: requests for the scheduler (queries, chat
turns, completions) and task bodies (ingestion, deletion, embeddings).

The query path and the chat-turn algorithm live beside it (ragkv.app.query,
ragkv.app.chat.turn); this module builds their requests with the server's limits and
reports each one's end to the observer. Bad input raises InputError before anything is
queued.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragkv.app.chat.contexts import ContextStore
from ragkv.app.chat.turn import ChatTurn, ChatTurns
from ragkv.app.completion import PassageRequest, completion_request, prompt_ids
from ragkv.app.query import query_request, question_prompt_ids
from ragkv.app.rag import QueryConfig
from ragkv.app.request import RequestCancelled
from ragkv.app.request_types import FusionConfig, GenerationConfig
from ragkv.app.runtime import Runtime
from ragkv.app.server.documents import IngestedDocument, Ingestion
from ragkv.app.server.observer import ServerObserver
from ragkv.app.server.request_stream import RequestStream
from ragkv.app.server.task import Task


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray
    """[n, dimension] float32 unit rows, one per text."""
    tokens: int
    """Tokens read."""


class ModelWork:
    def __init__(
        self,
        runtime: Runtime,
        sessions: ContextStore,
        max_input_tokens: int | None = None,
        observer: ServerObserver | None = None,
    ):
        """`max_input_tokens`: the largest question, message or prompt (None: what the
        model's context takes)."""
        self.runtime = runtime
        self.rag = runtime.rag
        self.max_input_tokens = max_input_tokens
        self.observer = observer or ServerObserver()
        self.sessions = sessions
        runtime.passages.finder.prepare()  # at start-up (seconds for a large vocabulary), not on a request
        self.chat = ChatTurns(runtime.rag, sessions, max_input_tokens, passages=runtime.passages)

    # -- /v1/query ------------------------------------------------------------------

    def query_stream(self, question: str, tenant: str, config: QueryConfig) -> RequestStream:
        """A request the scheduler prepares and decodes (batched with the others)."""
        request = query_request(
            self.rag,
            question,
            tenant,
            config,
            max_input_tokens=self.max_input_tokens,
            arrival=time.perf_counter(),
            on_finished=self.observer.request_finished,
        )
        return RequestStream("query", [request], self.observer.stream_ended)

    def question_ids(self, question: str, config: QueryConfig) -> list[int]:
        return question_prompt_ids(self.runtime.rag, question, config, self.max_input_tokens)

    # -- /v1/chat/completions -------------------------------------------------------

    def chat_stream(self, turn: ChatTurn, context_id: str) -> RequestStream:
        request = self.chat.request(
            turn, context_id=context_id, arrival=time.perf_counter(), on_finished=self.observer.request_finished
        )
        return RequestStream("chat", [request], self.observer.stream_ended)

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
        all_ids = self.prompt_ids(prompts, generation)
        arrival = time.perf_counter()
        return RequestStream(
            "completion",
            [
                completion_request(
                    engine,
                    ids,
                    generation,
                    arrival=arrival,
                    on_finished=self.observer.request_finished,
                    passages=PassageRequest(self.runtime.passages, tenant, fusion or FusionConfig())
                    if prompt_spans
                    else None,
                )
                for ids in all_ids
            ],
            self.observer.stream_ended,
        )

    def prompt_ids(self, prompts: Sequence[str | list[int]], generation: GenerationConfig) -> list[list[int]]:
        """The ids each prompt prefills, every one checked (InputError) before anything runs."""
        return [
            prompt_ids(
                self.runtime.engine,
                prompt,
                generation,
                max_input_tokens=self.max_input_tokens,
                where=f"prompt {index}" if len(prompts) > 1 else "the prompt",
            )
            for index, prompt in enumerate(prompts)
        ]

    # -- ingestion and deletion -----------------------------------------------------

    def ingest_body(self, ingestion: Ingestion, progress=None):
        """An ingestion as a task body: one step per batch of chunk encodes, so the worker
        loop runs the requests' decode steps between them (a cancelled task is closed
        between two steps, which rolls back what it wrote). Its result: IngestedDocument."""
        runtime = self.runtime
        tenant = ingestion.tenant

        def body(task: Task):
            result = yield from runtime.ingestor.ingest_steps(
                ingestion.text,
                ingestion.name,
                tenant=tenant,
                metadata=ingestion.metadata,
                progress=progress,
                pages=ingestion.pages,
                replaces=ingestion.replaces,
            )
            # chunks that carry context (--context-neighbours): one chunk's recompute per step
            try:
                yield from runtime.contextualize_steps(tenant, [result.doc_id])
            except RequestCancelled:
                pass  # the document is in; its chunks keep the K/V ingestion stored
            return IngestedDocument(runtime.registry.get(tenant, result.doc_id), result)

        return body

    def embeddings_body(self, texts: list[str]):
        """The texts' Embeddings."""
        embedder = self.runtime.embedder

        def body(task: Task):
            tokenizer = embedder.model.tokenizer
            tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"])
            return Embeddings(np.asarray(embedder.embed_passages(texts), dtype=np.float32), tokens)
            yield  # a generator: embedding is one step

        return body

    def delete_body(self, doc_id: str, tenant: str):
        def body(task: Task):
            return self.runtime.ingestor.delete(doc_id, tenant)
            yield

        return body
