"""A chat turn as a scheduler request: the longest cached prefix, then only what is new.

    fetch (no model: ahead of admission, ragkv.app.server.prefetch)
             retrieval for the last user message, its chunks' stored K/V read, their citations
    prepare (the model thread)
    messages ─► conversation ids (chat template, roles kept; ragkv.app.chat.conversation)
             ─► base context: the named session (session_id), else the tenant's cached
                context with the longest common prefix (ragkv.app.chat.contexts)
             ─► the fetched chunks
             ─► the plan (ragkv.app.chat.plan): the base's rows reused, and one of
    new chunks      [base rows | conversation up to the last user message's content,
                    "Documents:\\n" | new chunks | "\\n\\nQuestion: " + the message and
                    the template's closing], fused by the query's strategy with everything
                    before the chunks as its prefix (position recovery puts the chunks'
                    keys after it); chunks the base holds before the reused point are not
                    fused again
    pasted passages the new tokens with the passages the chunk store holds fused in
                    (ragkv.app.passages)
    otherwise       prefill conversation ids past the reused prefix onto the base's rows
             ─► the plan carried out (`Computed`: cache, logits, usage, what its rows are)
             ─► decode (batched with the other running requests)
             ─► the turn's context (prompt rows + the answer's rows) is saved as the plan
                says: under its session id when the client named one, else as an
                anonymous context

A base context found by prefix is taken over (moved, not copied) when the whole of it is
the prefix and it is anonymous; otherwise its prefix rows are copied. A named session is
checked out for the turn; a turn that fails or is cancelled leaves it as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from ragkv.app.chat.contexts import Context, ContextStore, Insertion, new_context_id
from ragkv.app.chat.conversation import Conversation, render_conversation
from ragkv.app.chat.plan import (
    NO_BASE,
    Base,
    FuseChunks,
    FusePassages,
    Opening,
    PassageLookup,
    PrefillTail,
    TurnIds,
    TurnPlan,
    plan_turn,
    session_opening,
    user_messages,
)
from ragkv.app.limits import check_context_length
from ragkv.app.passages import PromptPassages
from ragkv.app.query import CHUNK_TOKENS_ESTIMATE, check_input_tokens
from ragkv.app.rag import QueryConfig, RagPipeline, tensor_bytes
from ragkv.app.request import Fetched, Prepared, Request, RequestInfo, RequestOutput, fused_prompt_ids
from ragkv.app.usage import TokenUsage
from ragkv.engine.kv_cache import KVCache, Tail
from ragkv.engine.prompt import RAG_INSTRUCTION
from ragkv.fusion import FusionInput, FusionResult
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
    """Reuse passages pasted into the messages from the chunk store (ragkv.app.passages);
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
class ChatFetch(Fetched):
    """A RAG turn's chunks, read before the model: retrieved for its last message (least
    relevant first), their stored tensors by chunk hash (None: the store has none), their
    citations."""

    retrieved: list = field(default_factory=list)
    entries: dict = field(default_factory=dict)
    citations: list = field(default_factory=list)


@dataclass(frozen=True)
class Computed:
    """What carrying out a plan's work gives: the prompt's cache and the logits of its last
    row, and what the cache's rows are."""

    cache: KVCache
    logits: torch.Tensor
    usage: TokenUsage
    strategy: str
    """The fusion strategy's name; "prefix" or "none" for a prefill."""
    fused: list[int] | None
    """The prompt ids as fused (request.fused_prompt_ids); None for a prefill."""
    row_ids: list[int]
    """Token id of every prompt row."""
    insertions: list[Insertion]
    """The document blocks among them."""

    @classmethod
    def of_fusion(cls, fusion: FusionResult, usage: TokenUsage, strategy: str, insertions: list[Insertion]) -> Computed:
        row_ids = fusion.layout.token_ids.tolist()
        return cls(fusion.cache, fusion.logits, usage, strategy, fused_prompt_ids(fusion), row_ids, insertions)


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
        """What the holder of `context` is about to cut to `kept` rows (before `Context.cut`)."""
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
        """Give `context` back as it was before the cut, its rows, ids and insertions (the
        turn failed or was cancelled); its holder then releases it to the store."""
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
        conversation = self.conversation(turn)
        state = _Turn(self, turn, turn.session_id or context_id or new_context_id(), on_finished, conversation)
        estimate = sum(len(m["content"]) for m in turn.messages) // 3 + turn.config.top_k * CHUNK_TOKENS_ESTIMATE
        return Request(
            "chat",
            state.prepare,
            turn.config.generation,
            estimated_tokens=estimate,
            arrival=arrival,
            on_finished=state.finished,
            on_dropped=state.dropped,
            fetch=state.fetch if turn.rag else None,
        )

    def conversation(self, turn: ChatTurn) -> Conversation:
        """The turn's messages as the chat template renders them: the ids the turn prefills
        when nothing is cached and nothing retrieved, and the fewest its prompt can hold.
        Checked before the turn reads a store or runs the model (InputError): the last
        message within max_input_tokens, these ids and the answer within the model's context."""
        check_tenant(turn.tenant)
        check_input_tokens(self.engine, turn.messages[-1]["content"], self.max_input_tokens, "the last message")
        conversation = render_conversation(self.engine.prompt, turn.messages)
        check_context_length(
            self.engine,
            len(conversation.token_ids),
            turn.config.generation.max_new_tokens,
            "the conversation",
            "shorten it or lower max_tokens",
        )
        return conversation


class _Turn:
    """One turn: opens (holds or finds its base), plans, carries the plan out; then saves
    what it leaves (`finished`) or gives a held base back whole (`dropped`)."""

    def __init__(self, turns: ChatTurns, turn: ChatTurn, context_id: str, on_finished, conversation: Conversation):
        self.turns = turns
        self.turn = turn
        self.conversation = conversation
        """The messages sent, rendered (ChatTurns.conversation)."""
        self.engine = turns.engine
        self.context_id = context_id
        self._on_finished = on_finished
        self.held: Context | None = None
        """The base context this turn holds (checked out or taken): `dropped` gives it back."""
        self.saved: _Saved | None = None
        """The held base as it was before the turn cut it (given back if the turn fails)."""
        self.plan: TurnPlan | None = None
        self.computed: Computed | None = None
        self.entries: dict = {}
        """The fetched chunks' stored tensors by chunk hash (ChatFetch)."""

    # -- fetch: retrieval and store reads, no model -------------------------------------

    def fetch(self, request: Request) -> ChatFetch:
        retrieved = self._retrieve(request)
        if not retrieved:
            return ChatFetch()
        rag = self.turns.rag
        entries = dict(zip((chunk.chunk_hash for _, chunk, _ in retrieved), rag.read_chunks(retrieved)))
        citations = rag.cite(self.turn.tenant, retrieved)
        return ChatFetch(tensor_bytes(entries.values()), retrieved, entries, citations)

    # -- prepare: open, plan, run -----------------------------------------------------

    def prepare(self, request: Request) -> Prepared:
        turn = self.turn
        opening = self._open()
        fetched = request.fetched if request.fetched is not None else ChatFetch()
        retrieved, self.entries = fetched.retrieved, fetched.entries
        self.plan = plan = plan_turn(
            opening,
            retrieved,
            self._ids() if retrieved else None,
            lookup=self._lookup(),
            context_id=self.context_id,
            session=turn.session_id is not None,
        )
        citations = fetched.citations
        self.computed = computed = self._run(request, plan, self._prefix_cache(plan))
        info = ChatInfo(plan.save.context_id, plan.save.turns, plan.new_chunks, plan.reuse.rows)
        return Prepared(
            computed.cache,
            computed.logits,
            computed.usage,
            computed.strategy,
            citations,
            None,
            info,
            computed.fused,
            release_window_rows=self.turns.release_window_rows,
        )

    def _open(self) -> Opening:
        """The named session, checked out; else the tenant's context with the longest common
        prefix, taken when the whole of it is the prefix and it is anonymous."""
        turn, prompt, fingerprint = self.turn, self.engine.prompt, self.engine.fingerprint
        contexts = self.turns.contexts
        if turn.session_id is not None:
            self.held = context = contexts.checkout(turn.tenant, turn.session_id)
            return session_opening(prompt, fingerprint, context, turn.messages)
        conversation = self.conversation
        base = NO_BASE
        match = contexts.match(turn.tenant, fingerprint, conversation.token_ids)
        if match is not None and match.conversation_tokens > 0:
            whole = match.conversation_tokens == len(match.context.conversation_ids)
            held = whole and not match.context.explicit and contexts.take(match.context)
            if held:
                self.held = match.context
            base = Base(match.context, match.conversation_tokens, held)
        return Opening(conversation, base, user_messages(turn.messages))

    def _retrieve(self, request: Request) -> list:
        turn = self.turn
        if not turn.rag or not conversation_text(turn).strip():
            return []  # a blank message has nothing to search for
        started = time.perf_counter()
        config = turn.config
        retrieved = self.turns.rag.retrieve(
            conversation_text(turn), turn.tenant, config.top_k, config.doc_ids, config.retrieval, config.filter
        )
        request.timings.retrieve = time.perf_counter() - started
        return retrieved

    def _ids(self) -> TurnIds:
        """What a fusion of retrieved chunks splices in (asked only when chunks were retrieved)."""
        prompt = self.engine.prompt
        return TurnIds(prompt.encode(RAG_INSTRUCTION), prompt.encode(QUESTION_LEAD), self.engine.chunk_prefix_ids)

    def _lookup(self) -> PassageLookup | None:
        passages = self.turns.passages
        if passages is None or not self.turn.prompt_spans:
            return None
        return partial(passages.plan, self.turn.tenant)

    def _prefix_cache(self, plan: TurnPlan) -> KVCache | None:
        """The reused rows: the held base cut to them (in place; what it cuts is saved), or a
        copy with room for the rest of the prompt, the answer and the next turn."""
        reuse, context = plan.reuse, plan.base.context
        if reuse.conversation_tokens == 0:
            return None
        if plan.base.held:
            self.saved = _Saved.of(context, reuse.rows, self.engine.model.spec.sliding_window)
            context.cut(reuse.conversation_tokens)
            return context.cache
        new_tokens = len(plan.conversation.token_ids) - reuse.conversation_tokens
        prefix = context.cache.clone(new_tokens + self._max_new + NEXT_TURN_ROWS, rows=reuse.rows)
        prefix.next_position = reuse.rows
        return prefix

    @property
    def _max_new(self) -> int:
        return self.turn.config.generation.max_new_tokens

    def _room(self, rows: int) -> None:
        check_context_length(
            self.engine, rows, self._max_new, "the conversation", "start a new conversation or lower max_tokens"
        )

    def _run(self, request: Request, plan: TurnPlan, cache: KVCache | None) -> Computed:
        if isinstance(plan.work, FuseChunks):
            return self._fuse(request, plan, plan.work, cache)
        if isinstance(plan.work, FusePassages):
            return self._fuse_passages(request, plan, plan.work, cache)
        return self._prefill(request, plan, plan.work, cache)

    def _prefill(self, request: Request, plan: TurnPlan, work: PrefillTail, cache: KVCache | None) -> Computed:
        model, tail, rows = self.engine.model, work.ids, plan.reuse.rows
        self._room(rows + len(tail))
        started = time.perf_counter()
        if cache is None:
            cache = model.new_cache(len(tail) + self._max_new + NEXT_TURN_ROWS)
        elif cache.capacity < rows + len(tail) + self._max_new:
            cache = cache.clone(extra_capacity=len(tail) + self._max_new + NEXT_TURN_ROWS)
            if plan.base.held:
                plan.base.context.cache = cache
        logits = model.prefill(torch.tensor(tail), cache)
        request.timings.prefill = time.perf_counter() - started
        usage = TokenUsage(prompt_tokens=cache.length, cached_tokens=rows)
        strategy = "prefix" if rows else "none"
        return Computed(cache, logits, usage, strategy, None, plan.reuse.row_ids + tail, plan.reuse.insertions)

    def _fuse_passages(self, request: Request, plan: TurnPlan, work: FusePassages, cache: KVCache | None) -> Computed:
        """The new tokens with their pasted passages fused in: the text before the first
        passage is prefilled onto the reused rows, then fused into in place."""
        self._room(len(work.ids))
        strategy = self.turn.config.fusion.build(self.turns.passages.calibrated.fusion)
        fused = self.turns.passages.prepare_prompt(
            self.turn.tenant, work.ids, strategy, self._max_new, plan=work.passages, prefix_cache=cache
        )
        request.timings.prefill, request.timings.fuse = fused.prefill_s, fused.fuse_s
        self._drop_copied(plan, fused.cache)
        return Computed.of_fusion(fused.fusion, fused.usage, fused.strategy, plan.reuse.insertions)

    def _fuse(self, request: Request, plan: TurnPlan, work: FuseChunks, cache: KVCache | None) -> Computed:
        engine, model, max_new = self.engine, self.engine.model, self._max_new
        self._room(len(work.prefix_ids) + work.chunk_rows + len(work.question_ids))
        started = time.perf_counter()
        computed_before = 0
        if work.shared_prefix:
            prefix_cache = engine.chunk_prefix_cache()
        else:
            prefix_cache = cache if cache is not None else model.new_cache(len(work.glue))
            model.prefill(torch.tensor(work.glue), prefix_cache)
            computed_before = len(work.glue)
            request.timings.prefill = time.perf_counter() - started
        load_started = time.perf_counter()
        entries = [self.entries.get(chunk.chunk_hash) for _, chunk, _ in work.chunks]
        read = all(chunk.chunk_hash in self.entries for _, chunk, _ in work.chunks)
        chunks, recomputed = self.turns.rag.load_chunks(
            self.turn.tenant, work.chunks, entries=entries if read else None
        )
        request.timings.load = time.perf_counter() - load_started
        fuse_started = time.perf_counter()
        strategy = self.turn.config.fusion.build(self.turns.rag.calibrated.fusion)
        prefix_len = len(engine.chunk_prefix_ids)
        fusion_input = FusionInput(work.prefix_ids, chunks, work.question_ids, prefix_len, work.question_text)
        self._room(Layout.of(fusion_input).length)
        # a prefix this turn owns (the conversation's rows and the glue) is fused into in
        # place: copying it would cost in proportion to the conversation. In place it needs
        # room for the answer only: asking for the next turn's rows too would copy the
        # conversation whenever the previous turn's spare rows are used up (growing doubles).
        in_place = not work.shared_prefix
        extra = max_new if in_place else max_new + NEXT_TURN_ROWS
        fusion = strategy.fuse(model, fusion_input, prefix_cache, extra, in_place=in_place)
        request.timings.fuse = time.perf_counter() - fuse_started
        self._drop_copied(plan, fusion.cache)
        insertions = plan.reuse.insertions + [work.insertion(fusion.layout.num_document_tokens)]
        usage = TokenUsage.of_fusion(fusion, computed_before, recomputed)
        return Computed.of_fusion(fusion, usage, strategy.name, insertions)

    def _drop_copied(self, plan: TurnPlan, fused: KVCache) -> None:
        """A fusion that copied the held base's rows leaves the base at its own rows."""
        context = plan.base.context
        if plan.base.held and fused is not context.cache:
            context.cache.truncate(len(context.row_ids))

    # -- after the turn -------------------------------------------------------------

    def finished(self, request: Request, completion: RequestOutput) -> None:
        plan, computed, turn = self.plan, self.computed, self.turn
        save, cache = plan.save, request.cache
        answered = request.output_ids[: cache.length - len(computed.row_ids)]
        context = Context(
            save.context_id,
            turn.tenant,
            self.engine.fingerprint,
            plan.conversation.token_ids + answered,
            computed.row_ids + answered,
            cache,
            computed.insertions,
            explicit=save.session,
            turns=save.turns,
            created=save.created if save.created is not None else time.time(),
        )
        contexts = self.turns.contexts
        if save.session:
            contexts.release(turn.tenant, save.context_id, context)
        else:
            if self.held is not None:
                contexts.release(self.held.tenant, self.held.id, None)
            contexts.put(context)
        completion.info.session = context.summary()  # "shared": app.server.publication, once published
        if self._on_finished is not None:
            self._on_finished(request, completion)

    def dropped(self, request: Request) -> None:
        """Failed or cancelled: a held base goes back whole, as it was before the turn."""
        context = self.held
        if context is None:
            return
        if self.saved is not None:
            self.saved.restore(context)
        else:  # not cut: at most rows past its own were written
            context.cache.truncate(min(context.cache.length, len(context.row_ids)))
        self.turns.contexts.release(context.tenant, context.id, context)


def conversation_text(turn: ChatTurn) -> str:
    """What retrieval searches for: the last user message."""
    return turn.messages[-1]["content"]
