"""What the model worker runs: query, chat turn, ingestion and deletion bodies.

Each body is a generator run on the worker thread (see api.worker): every `next()` is
one unit of model work, so the worker can interleave requests and stop a cancelled one
between two tokens. Bodies yield `("prepared", info)` once the first token's logits are
ready, then `("token", text)` per decoded token, and return the final outcome.

Chat turns (see api.sessions for what a session holds):
  turn 1      like /v1/query: retrieve, load the chunks' KV, fuse [prefix | chunks |
              question]; without documents (or with rag disabled) a plain prefill of the
              rendered messages. Earlier messages sent with a new session are folded into
              the question text.
  turn N+1    the session's cache is an exact prefix; the previous answer and the new
              message (ChatPrompt.turn_ids) are prefilled onto it. If retrieval for the
              new message finds chunks the session does not hold yet, they are fused in
              after the turns: the previous answer and the next user turn's opening
              ("Documents:") are prefilled, then the fusion strategy runs with the whole
              session as its prefix, the new chunks' keys rotated to their positions after
              it (position recovery) and the strategy's selective recompute applied to them.
  after       the cache is cut back to the end of the prompt (the answer is re-fed as text
              next turn, exactly as the chat template renders it) and the session saved.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import torch

from ragkv.api.config import ServeConfig
from ragkv.api.errors import ApiError, as_api_error
from ragkv.api.metrics import Metrics
from ragkv.api.sessions import MemorySessions, RedisSessions, Session
from ragkv.api.worker import Job
from ragkv.ingest.errors import InputError
from ragkv.fusion import FusionInput, FusionResult
from ragkv.engine.generation import TokenEvent
from ragkv.engine.prompt import RAG_INSTRUCTION
from ragkv.app.query import query_request
from ragkv.app.rag import Citation, QueryConfig
from ragkv.app.request import Completion, Request
from ragkv.app.runtime import Runtime
from ragkv.app.usage import Usage, chunk_rows_computed_here

log = logging.getLogger("ragkv.api.service")

@dataclass
class TurnOutcome:
    """The end of a query or chat turn."""

    text: str
    finish_reason: str
    citations: list[dict]
    usage: dict[str, int]
    timings: dict[str, float]
    strategy: str
    session: dict | None = None
    new_chunks: int = 0


@dataclass
class Prepared:
    """A cache whose last row produced `logits`, ready to decode."""

    cache: object
    logits: torch.Tensor
    usage: dict[str, int]
    citations: list[dict]
    timings: dict[str, float]
    strategy: str
    chunk_hashes: list[str] = field(default_factory=list)
    new_chunks: int = 0


def citation_dict(citation: Citation) -> dict:
    return {"document_id": citation.doc_id, "name": citation.name, "chunk_index": citation.chunk_index,
            "char_start": citation.char_start, "char_end": citation.char_end, "score": citation.score, "text": citation.text}


def fusion_usage(fusion: FusionResult, computed_before: int = 0, recomputed_chunks: tuple[int, ...] | list[int] = ()) -> dict[str, int]:
    """reused = prompt rows whose KV was not computed for this request (stored chunks kept
    as they are, the cached prefix, a session's earlier turns); computed = rows computed
    (recomputed document rows, chunks the store could not give, the question, a new turn)."""
    length = fusion.layout.length
    extra = chunk_rows_computed_here(fusion, recomputed_chunks)
    reused = max(0, length - int(fusion.final_rows.numel()) - computed_before - extra)
    return {
        "prompt_tokens": length,
        "document_tokens": fusion.layout.num_document_tokens,
        "reused_tokens": reused,
        "recomputed_tokens": fusion.recomputed_tokens + extra,
        "computed_tokens": length - reused,
    }


class Service:
    def __init__(self, runtime: Runtime, config: ServeConfig, metrics: Metrics, sessions: MemorySessions | RedisSessions):
        self.runtime = runtime
        self.engine = runtime.engine
        self.rag = runtime.rag
        self.config = config
        self.metrics = metrics
        self.sessions = sessions
        self.max_positions = self.engine.spec.rope.max_position_embeddings

    # -- shared pieces --------------------------------------------------------------

    def _check_input_tokens(self, text: str, what: str) -> int:
        count = len(self.engine.tokenize(text))
        if count > self.config.max_input_tokens:
            raise ApiError(400, "too_many_tokens", f"{what} is {count} tokens; the limit is {self.config.max_input_tokens}")
        return count

    @staticmethod
    def _decode(events: Iterator[TokenEvent]) -> Generator[tuple[str, object], None, tuple[str, str, int, float]]:
        """Yield ("token", text) per token; return (text, finish reason, tokens, seconds)."""
        started = time.perf_counter()
        pieces, finish, generated = [], "length", 0
        for event in events:
            generated += 1
            pieces.append(event.text)
            finish = event.finish_reason or finish
            if event.text:
                yield ("token", event.text)
        return "".join(pieces), finish, generated, time.perf_counter() - started

    def _record(self, endpoint: str, phase: str, job: Job, outcome: TurnOutcome, hits: int, misses: int) -> None:
        self.metrics.ttft.labels(endpoint, phase).observe(outcome.timings["ttft"])
        self.metrics.queue_wait.labels(job.kind).observe(job.queue_seconds)
        usage = outcome.usage
        self.metrics.record_usage(Usage(usage["prompt_tokens"], usage["reused_tokens"], usage["recomputed_tokens"],
                                        usage["document_tokens"], usage["completion_tokens"]), hits, misses)

    # -- /v1/query ------------------------------------------------------------------

    def query_job(self, question: str, tenant: str, config: QueryConfig) -> Job:
        """A job whose model request the scheduler prepares and decodes (batched with others)."""
        try:
            request = query_request(self.rag, question, tenant, config, max_input_tokens=self.config.max_input_tokens,
                                    arrival=time.perf_counter(), on_finished=self._record_query)
        except InputError as error:
            raise as_api_error(error) from None
        return Job("query", request=request)

    def _record_query(self, request: Request, completion: Completion) -> None:
        self.metrics.ttft.labels("query", "fused").observe(completion.timings.ttft)
        self.metrics.queue_wait.labels("query").observe(completion.timings.queue)
        missing = completion.info.get("missing_chunks", 0)
        self.metrics.record_usage(completion.usage, len(completion.citations) - missing, missing)


    # -- /v1/chat/completions -------------------------------------------------------

    def chat_body(self, tenant: str, session_id: str, messages: list[dict[str, str]], rag_enabled: bool,
                  config: QueryConfig):
        """Chat turns decode dense: a session keeps and extends its exact KV, which sparse
        eviction (SnapKV) would cut and sparse selectors are not built for."""

        def body(job: Job):
            started = time.perf_counter()
            session = self.sessions.checkout(tenant, session_id)
            keep: Session | None = session
            original = (session.length, len(session.token_ids)) if session is not None else None
            try:
                if session is not None and session.fingerprint != self.engine.fingerprint:
                    log.warning("session %s was computed by another model; starting it afresh", session_id)
                    session = keep = None
                    original = None
                session_s = time.perf_counter() - started
                if session is None:
                    prepared, session = self._first_turn(tenant, session_id, messages, rag_enabled, config)
                    phase = "first_turn"
                else:
                    prepared = self._next_turn(tenant, session, messages, rag_enabled, config)
                    phase = "next_turn"
                prompt_rows = prepared.cache.length
                prepared.timings["session"] = round(session_s, 4)
                prepared.timings["ttft"] = round(time.perf_counter() - started, 4)
                yield ("prepared", {"citations": prepared.citations, "timings": dict(prepared.timings),
                                    "strategy": prepared.strategy, "session_id": session_id})
                events = self.engine.stream(prepared.cache, prepared.logits, config.generation)
                text, finish, generated, decode_s = yield from self._decode(events)
                # Cut the decoded rows: next turn re-feeds the answer as the template renders it.
                prepared.cache.truncate(prompt_rows)
                session.cache = prepared.cache
                session.token_ids = session.token_ids[:prompt_rows]
                session.last_answer = text
                session.chunk_hashes = session.chunk_hashes + prepared.chunk_hashes
                session.citations = prepared.citations or session.citations
                session.turns += 1
                session.updated = time.time()
                session.version = uuid.uuid4().hex
                if session.cache.capacity > 1.25 * session.length:
                    session.compact()
                keep, original = session, None
                timings = prepared.timings
                timings["decode"] = round(decode_s, 4)
                timings["queue"] = round(job.queue_seconds, 4)
                usage = {**prepared.usage, "completion_tokens": generated,
                         "total_tokens": prepared.usage["prompt_tokens"] + generated}
                outcome = TurnOutcome(text.strip(), finish, prepared.citations, usage, timings, prepared.strategy,
                                      {**session.summary()}, prepared.new_chunks)
                self.metrics.sessions_turns.labels(phase).inc()
                hits = prepared.new_chunks - int(timings.get("missing_chunks_recomputed", 0))
                self._record("chat", phase, job, outcome, max(hits, 0), int(timings.pop("missing_chunks_recomputed", 0)))
                return outcome
            finally:
                if original is not None and keep is not None:
                    # The turn failed or was cancelled: rows it appended are dropped, the
                    # session stays as it was before the turn.
                    keep.cache.truncate(original[0])
                    keep.token_ids = keep.token_ids[: original[1]]
                self.sessions.release(tenant, session_id, keep)

        return body

    def _fold_messages(self, messages: list[dict[str, str]]) -> str:
        """The question for a new session: the last user message, preceded by any earlier
        messages (the fused layout has one user turn, so history becomes its text)."""
        *history, last = messages
        if not history:
            return last["content"]
        lines = [f"{m['role']}: {m['content']}" for m in history]
        return "Conversation so far:\n" + "\n".join(lines) + "\n\nQuestion: " + last["content"]

    def _first_turn(self, tenant: str, session_id: str, messages: list[dict[str, str]], rag_enabled: bool,
                    config: QueryConfig) -> tuple[Prepared, Session]:
        prepared_query = None
        if rag_enabled:
            question = self._fold_messages(messages)
            self._check_input_tokens(question, "the messages")
            try:
                prepared_query = self.rag.prepare(question, tenant, config)
            except InputError as error:
                if error.reason != "no_documents":
                    raise
                # Nothing to retrieve from (yet): answer as a plain chat model.
        if prepared_query is not None:
            fusion = prepared_query.fusion
            citations, hashes = [c.to_dict() for c in prepared_query.citations], prepared_query.chunk_hashes
            timings = {k: round(v, 4) for k, v in prepared_query.timings.items()}
            timings["missing_chunks_recomputed"] = len(prepared_query.recomputed_chunks)
            prepared = Prepared(fusion.cache, fusion.logits, fusion_usage(fusion, 0, prepared_query.recomputed_chunks),
                                citations, timings, prepared_query.strategy, hashes, len(hashes))
            token_ids = fusion.layout.token_ids.tolist()
        else:
            token_ids = self.engine.prompt.encode_messages(messages)
            if len(token_ids) > self.config.max_input_tokens:
                raise ApiError(400, "too_many_tokens", f"the messages are {len(token_ids)} tokens; the limit is {self.config.max_input_tokens}")
            prefill_started = time.perf_counter()
            cache, logits = self.engine.prefill(token_ids, config.generation.max_new_tokens)
            timings = {"prefill": round(time.perf_counter() - prefill_started, 4)}
            usage = {"prompt_tokens": len(token_ids), "document_tokens": 0, "reused_tokens": 0,
                     "recomputed_tokens": 0, "computed_tokens": len(token_ids)}
            prepared = Prepared(cache, logits, usage, [], timings, "none")
        session = Session(session_id, tenant, self.engine.fingerprint, token_ids, prepared.cache)
        return prepared, session

    def _next_turn(self, tenant: str, session: Session, messages: list[dict[str, str]], rag_enabled: bool,
                   config: QueryConfig) -> Prepared:
        message = messages[-1]["content"]
        self._check_input_tokens(message, "the message")
        prompt = self.engine.prompt
        max_new = config.generation.max_new_tokens
        timings: dict[str, float] = {}
        new = []
        if rag_enabled:
            retrieve_started = time.perf_counter()
            retrieved = self.rag.retrieve(message, tenant, config.top_k, config.doc_ids)
            held = set(session.chunk_hashes)
            new = [item for item in retrieved if item[1].chunk_hash not in held]
            new = list({item[1].chunk_hash: item for item in new}.values())
            timings["retrieve"] = round(time.perf_counter() - retrieve_started, 4)
        previous = session.last_answer
        reused = session.length
        if not new:
            ids = prompt.turn_ids(message, previous)
            self._check_room(session, len(ids) + max_new)
            prefill_started = time.perf_counter()
            session.cache.reserve(session.length + len(ids) + max_new)
            logits = self.engine.model.prefill(torch.tensor(ids), session.cache)
            session.token_ids = session.token_ids + ids
            timings["prefill"] = round(time.perf_counter() - prefill_started, 4)
            usage = {"prompt_tokens": session.length, "document_tokens": 0, "reused_tokens": reused,
                     "recomputed_tokens": 0, "computed_tokens": len(ids)}
            return Prepared(session.cache, logits, usage, [], timings, "session")

        # New chunks: [session | previous answer, next user turn's opening | new chunks | question]
        glue = prompt.encode((previous or "") + prompt.between_turns + RAG_INSTRUCTION) if previous is not None \
            else prompt.encode(RAG_INSTRUCTION)
        segments = prompt.rag_segments(message)
        chunk_tokens = sum(chunk.token_end - chunk.token_start for _, chunk, _ in new)
        self._check_room(session, len(glue) + chunk_tokens + len(segments.question_ids) + max_new)
        prefill_started = time.perf_counter()
        session.cache.reserve(session.length + len(glue))
        self.engine.model.prefill(torch.tensor(glue), session.cache)
        session.token_ids = session.token_ids + glue
        timings["prefill"] = round(time.perf_counter() - prefill_started, 4)
        load_started = time.perf_counter()
        chunks, missing = self.rag.load_chunks(tenant, new)
        timings["load"] = round(time.perf_counter() - load_started, 4)
        timings["missing_chunks_recomputed"] = len(missing)
        fuse_started = time.perf_counter()
        strategy = config.fusion.build()
        fusion_input = FusionInput(session.token_ids, chunks, segments.question_ids, len(self.engine.chunk_prefix_ids),
                                   segments.question_text_span)
        fusion = strategy.fuse(self.engine.model, fusion_input, session.cache, max_new)
        timings["fuse"] = round(time.perf_counter() - fuse_started, 4)
        session.token_ids = fusion.layout.token_ids.tolist()
        texts: dict[str, str] = {}
        citations = []
        for record, chunk, score in reversed(new):
            text = texts.get(record.doc_id) or texts.setdefault(record.doc_id, self.runtime.registry.text(tenant, record.doc_id))
            citations.append(citation_dict(Citation(record.doc_id, record.name, chunk.index, chunk.char_start, chunk.char_end,
                                                    round(score, 4), text[chunk.char_start : chunk.char_end])))
        usage = fusion_usage(fusion, computed_before=len(glue), recomputed_chunks=missing)
        usage["document_tokens"] = fusion.layout.num_document_tokens
        return Prepared(fusion.cache, fusion.logits, usage, citations, timings, strategy.name,
                        [chunk.chunk_hash for _, chunk, _ in new], len(new))

    def _check_room(self, session: Session, extra: int) -> None:
        if session.length + extra > self.max_positions:
            raise ApiError(400, "session_too_long",
                           f"the session holds {session.length} tokens; this turn needs {extra} more and the model's "
                           f"context is {self.max_positions}: start a new session")

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
