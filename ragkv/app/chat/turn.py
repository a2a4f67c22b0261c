"""A chat turn as a scheduler request: the longest cached prefix, then only what is new.

    messages ─► conversation ids (chat template, roles kept; ragkv.app.chat.conversation)
             ─► base context: the named session (session_id), else the tenant's cached
                context with the longest common prefix (ragkv.app.chat.contexts)
             ─► retrieval for the last user message; chunks the base already holds
                before the matched point are not fused again
    no new chunks   prefill conversation ids past the matched prefix onto the base's rows
    new chunks      [base rows | conversation up to the last user message's content,
                    "Documents:\\n" | new chunks | "\\n\\nQuestion: " + the message and
                    the template's closing], fused by the query's strategy with everything
                    before the chunks as its prefix (position recovery puts the chunks'
                    keys after it)
             ─► decode (batched with the other running requests)
             ─► the turn's context (prompt rows + the answer's rows) is saved: under its
                session id when the client named one, else as an anonymous context

A base context found by prefix is taken over (moved, not copied) when the whole of it is
the prefix and it is anonymous; otherwise its prefix rows are copied. A named session is
checked out for the turn; a turn that fails or is cancelled leaves it as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ragkv.app.chat.contexts import Context, ContextStore, Insertion, new_context_id
from ragkv.app.chat.conversation import Conversation, common_prefix, continue_conversation, render_conversation
from ragkv.app.limits import check_context_length
from ragkv.app.prompt_passages import PassagePlan, PromptPassages
from ragkv.app.query import CHUNK_TOKENS_ESTIMATE, check_input_tokens
from ragkv.app.rag import QueryConfig, RagPipeline
from ragkv.app.request import Prepared, Request, RequestInfo, RequestOutput, fused_prompt_ids
from ragkv.app.usage import TokenUsage
from ragkv.engine.kv_cache import KVCache, Tail
from ragkv.engine.prompt import RAG_INSTRUCTION
from ragkv.fusion import FusionInput
from ragkv.fusion.layout import Layout
from ragkv.ingest.registry import check_tenant

QUESTION_LEAD = "\n\nQuestion: "
NEXT_TURN_ROWS = 256
"""Rows a turn's cache keeps free beyond its answer, so the next turn (the end of the
answer, a message, its answer) usually extends it in place instead of copying it."""


@dataclass(frozen=True)
class ChatTurn:
    tenant: str
    messages: list[dict[str, str]]
    """Roles system, user, assistant; the last is the user's new message."""
    session_id: str | None
    """Continue this session (an error when unknown); None = match any cached context."""
    rag: bool
    config: QueryConfig
    prompt_spans: bool = True
    """Reuse passages pasted into the messages from the chunk store (ragkv.app.prompt_passages);
    False = prefill them as any other text."""


@dataclass
class ChatInfo(RequestInfo):
    session_id: str = ""
    """The context the turn leaves: its session, or the anonymous context's id."""
    turn: int = 1
    """The turn's number in its conversation."""
    new_chunks: int = 0
    """Chunks fused for this turn (not held by the context it started from)."""
    context_tokens: int = 0
    """Prompt rows taken from a cached context."""
    session: dict = field(default_factory=dict)
    """The saved context's summary (Context.summary), once the turn finished."""


@dataclass
class _Base:
    """What the turn starts from: a context, how much of it is reused, and whether the
    turn holds it (checked out or taken) rather than copying its rows."""

    context: Context | None
    conversation_tokens: int
    held: bool

    @property
    def rows(self) -> int:
        return self.context.rows_for(self.conversation_tokens) if self.context is not None else 0


@dataclass
class _Saved:
    """A held context before a turn cut it to the reused prefix. The turn writes its own
    rows after that prefix, in place, so the rows it cuts are copied here: a turn that
    fails or is cancelled gives the context back whole."""

    cache: KVCache
    length: int
    next_position: int
    conversation_ids: list[int]
    row_ids: list[int]
    insertions: list[Insertion]
    tail: Tail
    """Rows from the kept ones (which the turn never writes) to the end, and the rows before
    them that a sliding window reaches, should the turn's decode release them."""

    @classmethod
    def of(cls, context: Context, kept: int, window: int | None) -> _Saved:
        cache = context.cache
        return cls(
            cache,
            cache.length,
            cache.next_position,
            list(context.conversation_ids),
            list(context.row_ids),
            list(context.insertions),
            cache.tail(kept, window),
        )

    def restore(self, context: Context) -> None:
        cache = self.cache  # the turn may have moved the context to a larger copy; this one holds the prefix
        cache.restore(self.tail)
        context.cache = cache
        context.conversation_ids, context.row_ids, context.insertions = (
            self.conversation_ids,
            self.row_ids,
            self.insertions,
        )


class ChatTurns:
    """Builds chat-turn requests over one pipeline and one context cache."""

    def __init__(
        self,
        rag: RagPipeline,
        contexts: ContextStore,
        max_input_tokens: int | None = None,
        release_window_rows: bool = False,
        passages: PromptPassages | None = None,
    ):
        self.rag = rag
        self.passages = passages
        """Finds pasted passages in the new tokens of a turn (turns that ask for it); None = never."""
        self.engine = rag.engine
        self.contexts = contexts
        self.max_input_tokens = max_input_tokens
        self.release_window_rows = release_window_rows
        """Let a turn's decode drop the rows sliding-window layers no longer reach. Off: a
        follow-up that fuses a new chunk into the held context reads every layer's rows, and
        a released context would be recomputed instead (memory traded for TTFT)."""

    def request(
        self,
        turn: ChatTurn,
        *,
        context_id: str | None = None,
        arrival: float | None = None,
        on_finished: Callable[[Request, RequestOutput], None] | None = None,
    ) -> Request:
        """`context_id`: the id the turn's context gets when no session is named (default: a new one)."""
        check_tenant(turn.tenant)
        check_input_tokens(self.engine, turn.messages[-1]["content"], self.max_input_tokens, "the last message")
        state = _TurnState(self, turn, turn.session_id or context_id or new_context_id(), on_finished)
        estimate = sum(len(m["content"]) for m in turn.messages) // 3 + turn.config.top_k * CHUNK_TOKENS_ESTIMATE
        return Request(
            "chat",
            state.prepare,
            turn.config.generation,
            estimated_tokens=estimate,
            arrival=arrival,
            on_finished=state.finished,
            on_dropped=state.dropped,
        )


class _TurnState:
    def __init__(self, turns: ChatTurns, turn: ChatTurn, context_id: str, on_finished):
        self.turns = turns
        self.turn = turn
        self.engine = turns.engine
        self.base = _Base(None, 0, False)
        self.context_id = context_id
        self.number = sum(m["role"] == "user" for m in turn.messages)
        """The turn's number in its conversation (user messages so far, this one included)."""
        self.conversation: Conversation | None = None
        self.row_ids: list[int] = []
        self.insertions: list[Insertion] = []
        self.saved: _Saved | None = None
        """The held base as it was before the turn cut it (given back if the turn fails)."""
        self._on_finished = on_finished

    # -- prepare --------------------------------------------------------------------

    def prepare(self, request: Request) -> Prepared:
        turn = self.turn
        conversation = self._base_and_conversation()
        self.conversation = conversation
        retrieved = []
        if turn.rag:
            started = time.perf_counter()
            config = turn.config
            retrieved = self.turns.rag.retrieve(
                conversation_text(turn), turn.tenant, config.top_k, config.doc_ids, config.retrieval, config.filter
            )
            request.timings.retrieve = time.perf_counter() - started
        held = (
            self.base.context.chunks_before(self.base.conversation_tokens) if self.base.context is not None else set()
        )
        new = new_chunks(retrieved, held)
        reuse = self.base.conversation_tokens
        if new:
            reuse = min(reuse, conversation.question_start)
        reuse = min(reuse, len(conversation.token_ids) - 1)
        if reuse and not self._reusable(reuse, bool(new)):
            reuse = 0  # recomputed: the base's chunks are not in the prompt then, so all are new
            new = new_chunks(retrieved, set())
        cache = self._base_cache(
            reuse, len(conversation.token_ids) - reuse + turn.config.generation.max_new_tokens + NEXT_TURN_ROWS
        )
        context_rows = len(self.row_ids)
        citations = self.turns.rag.cite(turn.tenant, retrieved) if retrieved else []
        fused = None
        passages = self._passages(conversation) if not new else None
        if new:
            cache, logits, usage, strategy, fused = self._fuse(request, conversation, cache, new)
        elif passages is not None:
            cache, logits, usage, strategy, fused = self._fuse_passages(request, conversation, cache, *passages)
        else:
            cache, logits, usage, strategy = self._prefill(request, conversation, cache)
        info = ChatInfo(self.context_id, self.number, len(new), context_rows)
        return Prepared(
            cache,
            logits,
            usage,
            strategy,
            citations,
            None,
            info,
            fused,
            release_window_rows=self.turns.release_window_rows,
        )

    def _base_and_conversation(self) -> Conversation:
        turn, prompt, fingerprint = self.turn, self.engine.prompt, self.engine.fingerprint
        if turn.session_id is not None:
            context = self.turns.contexts.checkout(turn.tenant, turn.session_id)
            self.base = _Base(context, 0, True)
            # Another model's rows are not reused; the session keeps them until the turn succeeds.
            held_ids = context.conversation_ids if context.fingerprint == fingerprint else []
            only_new_message = all(m["role"] != "assistant" for m in turn.messages)
            if only_new_message and context.turns and held_ids:
                conversation = continue_conversation(prompt, held_ids, turn.messages[-1]["content"])
                self.number = context.turns + 1
            else:
                conversation = render_conversation(prompt, turn.messages)
            self.base.conversation_tokens = common_prefix(held_ids, conversation.token_ids)
            return conversation
        conversation = render_conversation(prompt, turn.messages)
        match = self.turns.contexts.match(turn.tenant, fingerprint, conversation.token_ids)
        if match is not None and match.conversation_tokens > 0:
            whole = match.conversation_tokens == len(match.context.conversation_ids)
            held = whole and not match.context.explicit and self.turns.contexts.take(match.context)
            self.base = _Base(match.context, match.conversation_tokens, held)
        return conversation

    def _reusable(self, reuse: int, fusing: bool) -> bool:
        """Whether the base's rows for `reuse` tokens can be read. A cache whose sliding-window
        layers released rows (in decode) serves a turn that appends to it, but not a cut
        before its window nor a fusion (which reads every layer's prefix rows)."""
        cache = self.base.context.cache
        if not cache.trimmed:
            return True
        rows = self.base.context.rows_for(reuse)
        return not fusing and (rows == cache.length or rows >= cache.earliest_cut)

    def _base_cache(self, reuse: int, extra_capacity: int) -> KVCache | None:
        """The base's rows for the first `reuse` conversation tokens, held, or copied with
        room for `extra_capacity` more."""
        base = self.base
        base.conversation_tokens = reuse
        if base.context is None or reuse == 0:
            self.row_ids, self.insertions = [], []
            return None
        context = base.context
        rows = context.rows_for(reuse)
        self.row_ids = context.row_ids[:rows]
        self.insertions = [i for i in context.insertions if i.at < reuse]
        if base.held:
            self.saved = _Saved.of(context, rows, self.engine.model.spec.sliding_window)
            context.cut(reuse)
            return context.cache
        prefix = context.cache.clone(extra_capacity, rows=rows)
        prefix.next_position = rows
        return prefix

    def _room(self, rows: int) -> None:
        check_context_length(
            self.engine,
            rows,
            self.turn.config.generation.max_new_tokens,
            "the conversation",
            "start a new conversation or lower max_tokens",
        )

    def _prefill(self, request: Request, conversation: Conversation, cache: KVCache | None):
        model, max_new = self.engine.model, self.turn.config.generation.max_new_tokens
        reused = self.base.conversation_tokens
        tail = conversation.token_ids[reused:]
        rows = len(self.row_ids)
        self._room(rows + len(tail))
        started = time.perf_counter()
        if cache is None:
            cache = model.new_cache(len(tail) + max_new + NEXT_TURN_ROWS)
        elif cache.capacity < rows + len(tail) + max_new:
            cache = cache.clone(extra_capacity=len(tail) + max_new + NEXT_TURN_ROWS)
            if self.base.held:
                self.base.context.cache = cache
        logits = model.prefill(torch.tensor(tail), cache)
        request.timings.prefill = time.perf_counter() - started
        self.row_ids = self.row_ids + tail
        usage = TokenUsage(prompt_tokens=cache.length, cached_tokens=rows)
        return cache, logits, usage, "prefix" if rows else "none"

    def _passages(self, conversation: Conversation) -> tuple[list[int], PassagePlan] | None:
        """The prompt's rows (the base's, then the new tokens) and the passages among its new
        tokens, when the server and the turn reuse pasted passages."""
        passages = self.turns.passages
        if passages is None or not self.turn.prompt_spans:
            return None
        if self.base.context is not None and self.base.context.cache.trimmed:
            return None  # a fusion reads every layer's prefix rows, which released windows lack
        ids = self.row_ids + conversation.token_ids[self.base.conversation_tokens :]
        plan = passages.plan(self.turn.tenant, ids, len(self.row_ids))
        return None if plan is None else (ids, plan)

    def _fuse_passages(
        self, request: Request, conversation: Conversation, cache: KVCache | None, ids: list[int], plan: PassagePlan
    ):
        """The new tokens with their pasted passages fused in: the text before the first
        passage is prefilled onto the base's rows, then fused into in place."""
        engine, model = self.engine, self.engine.model
        max_new = self.turn.config.generation.max_new_tokens
        self._room(len(ids))
        started = time.perf_counter()
        glue = ids[len(self.row_ids) : plan.spans[0].start]
        prefix_cache = cache if cache is not None else model.new_cache(len(glue))
        if glue:
            model.prefill(torch.tensor(glue), prefix_cache)
        request.timings.prefill = time.perf_counter() - started
        strategy = self.turn.config.fusion.build(engine.fusion_ratios)
        fuse_started = time.perf_counter()
        fused = self.turns.passages.fuse(ids, plan, prefix_cache, strategy, max_new, len(glue))
        request.timings.fuse = time.perf_counter() - fuse_started
        fusion = fused.fusion
        if self.base.held and fusion.cache is not self.base.context.cache:
            self.base.context.cache.truncate(len(self.base.context.row_ids))  # the fusion copied what it needed
        self.row_ids = fusion.layout.token_ids.tolist()
        return fusion.cache, fusion.logits, fused.usage, strategy.name, fused_prompt_ids(fusion)

    def _fuse(self, request: Request, conversation: Conversation, cache: KVCache | None, new: list):
        engine, turn, model = self.engine, self.turn, self.engine.model
        max_new = turn.config.generation.max_new_tokens
        reused = self.base.conversation_tokens
        glue = conversation.token_ids[reused : conversation.question_start] + engine.prompt.encode(RAG_INSTRUCTION)
        prefix_ids = self.row_ids + glue
        lead = engine.prompt.encode(QUESTION_LEAD)
        question_ids = lead + conversation.token_ids[conversation.question_start :]
        chunk_rows = sum(chunk.token_end - chunk.token_start for _, chunk, _ in new)
        self._room(len(prefix_ids) + chunk_rows + len(question_ids))
        started = time.perf_counter()
        computed_before = 0
        shared_prefix = cache is None and prefix_ids == engine.chunk_prefix_ids
        if shared_prefix:
            prefix_cache = engine.chunk_prefix_cache()
        else:
            prefix_cache = cache if cache is not None else model.new_cache(len(glue))
            model.prefill(torch.tensor(glue), prefix_cache)
            computed_before = len(glue)
            request.timings.prefill = time.perf_counter() - started
        load_started = time.perf_counter()
        chunks, recomputed = self.turns.rag.load_chunks(turn.tenant, new)
        request.timings.load = time.perf_counter() - load_started
        fuse_started = time.perf_counter()
        strategy = turn.config.fusion.build(engine.fusion_ratios)
        fusion_input = FusionInput(
            prefix_ids,
            chunks,
            question_ids,
            len(engine.chunk_prefix_ids),
            (len(lead), len(lead) + conversation.question_end - conversation.question_start),
        )
        self._room(Layout.of(fusion_input).length)
        # a prefix this turn owns (the conversation's rows and the glue) is fused into in
        # place: copying it would cost in proportion to the conversation. In place it needs
        # room for the answer only: asking for the next turn's rows too would copy the
        # conversation whenever the previous turn's spare rows are used up (growing doubles).
        in_place = not shared_prefix
        extra = max_new if in_place else max_new + NEXT_TURN_ROWS
        fusion = strategy.fuse(model, fusion_input, prefix_cache, extra, in_place=in_place)
        request.timings.fuse = time.perf_counter() - fuse_started
        if self.base.held and fusion.cache is not self.base.context.cache:
            self.base.context.cache.truncate(len(self.base.context.row_ids))  # the fusion copied what it needed
        self.row_ids = fusion.layout.token_ids.tolist()
        instruction = len(glue) - (conversation.question_start - reused)
        self.insertions = self.insertions + [
            Insertion(
                conversation.question_start,
                instruction + fusion.layout.num_document_tokens + len(lead),
                tuple(chunk.chunk_hash for _, chunk, _ in new),
            )
        ]
        usage = TokenUsage.of_fusion(fusion, computed_before, recomputed)
        return fusion.cache, fusion.logits, usage, strategy.name, fused_prompt_ids(fusion)

    # -- after the turn -------------------------------------------------------------

    def finished(self, request: Request, completion: RequestOutput) -> None:
        cache = request.cache
        answered = request.output_ids[: cache.length - len(self.row_ids)]
        base = self.base.context
        context = Context(
            self.context_id,
            self.turn.tenant,
            self.engine.fingerprint,
            self.conversation.token_ids + answered,
            self.row_ids + answered,
            cache,
            self.insertions,
            explicit=self.turn.session_id is not None,
            turns=self.number,
            created=base.created if base is not None and self.base.held else time.time(),
        )
        contexts = self.turns.contexts
        if self.turn.session_id is not None:
            contexts.release(self.turn.tenant, self.turn.session_id, context)
        else:
            if self.base.held:
                contexts.release(base.tenant, base.id, None)
            contexts.put(context)
        completion.info.session = {**context.summary(), "shared": contexts.shared(context)}
        if self._on_finished is not None:
            self._on_finished(request, completion)

    def dropped(self, request: Request) -> None:
        """Failed or cancelled: a held base goes back whole, as it was before the turn."""
        base = self.base
        if base.context is None or not base.held:
            return
        context = base.context
        if self.saved is not None:
            self.saved.restore(context)
        else:  # not cut: at most rows past its own were written
            context.cache.truncate(min(context.cache.length, len(context.row_ids)))
        self.turns.contexts.release(context.tenant, context.id, context)


def new_chunks(retrieved: list, held: set[str]) -> list:
    """The retrieved (record, chunk, score) whose chunk is not in `held`, each chunk once."""
    return list(
        {
            chunk.chunk_hash: (record, chunk, score)
            for record, chunk, score in retrieved
            if chunk.chunk_hash not in held
        }.values()
    )


def conversation_text(turn: ChatTurn) -> str:
    """What retrieval searches for: the last user message."""
    return turn.messages[-1]["content"]
