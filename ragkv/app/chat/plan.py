"""A chat turn's plan: what it reuses, fuses, prefills and saves, decided before any row is
computed (ragkv.app.chat.turn carries it out).

    Opening     the turn's conversation ids and the context it starts from (its base): a
                checked-out session, or the tenant's context with the longest common prefix,
                held (taken) or only read
    plan_turn   Opening + the retrieved chunks + a passage lookup ─► TurnPlan:
      reuse     the base's rows for its first conversation tokens (fewer than matched when
                chunks are fused before the last message, or none when a released sliding
                window cannot serve the cut)
      work      one of
                  FuseChunks     retrieved chunks the reused prefix does not hold, fused
                                 before the last message's content
                  FusePassages   passages pasted into the new tokens, found in the chunk store
                  PrefillTail    the conversation past the reused prefix, prefilled
      save      what the turn leaves once answered: its context id, session or anonymous

`plan_turn` reads the base context and calls the lookup; it changes nothing, so it can be
tested without a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ragkv.app.chat.contexts import Context, Insertion
from ragkv.app.chat.conversation import Conversation, common_prefix, continue_conversation, render_conversation
from ragkv.app.passages import PassagePlan
from ragkv.engine.prompt import ChatPrompt

PassageLookup = Callable[[list[int], int], PassagePlan | None]
"""(prompt ids, first new row) -> the passages among the new ids, or None (PromptPassages.plan
with the turn's tenant)."""


@dataclass(frozen=True)
class Base:
    """What the turn starts from: a context, how many of its conversation tokens the turn's
    conversation shares, and whether the turn holds it (checked out or taken) rather than
    copying its rows."""

    context: Context | None
    matched_tokens: int
    held: bool


NO_BASE = Base(None, 0, False)


@dataclass(frozen=True)
class Opening:
    conversation: Conversation
    base: Base
    number: int
    """The turn's number in its conversation."""


@dataclass(frozen=True)
class TurnIds:
    """The fixed token ids a turn splices in around fused chunks."""

    instruction: list[int]
    """The RAG instruction, after the conversation up to the last message's content."""
    lead: list[int]
    """Before the last message's content, after the chunks."""
    chunk_prefix: list[int]
    """The engine's shared chunk prefix (a turn whose whole prefix it is starts from its cache)."""


@dataclass(frozen=True)
class Reuse:
    """The base context's rows the turn reads: those of its first `conversation_tokens`
    conversation tokens (none when 0)."""

    conversation_tokens: int
    row_ids: list[int]
    """Token id of every reused row (documents spliced in)."""
    insertions: list[Insertion]
    """The base's document blocks within the reused rows."""

    @property
    def rows(self) -> int:
        return len(self.row_ids)


@dataclass(frozen=True)
class PrefillTail:
    """Prefill the conversation past the reused prefix onto its rows."""

    ids: list[int]


@dataclass(frozen=True)
class FuseChunks:
    """Fuse new chunks: [reused rows | glue | chunks | question], the glue prefilled onto the
    reused rows first (unless the whole prefix is the engine's shared chunk prefix)."""

    chunks: list
    """Retrieved (record, chunk, score), each chunk once, none the reused prefix holds."""
    glue: list[int]
    """The conversation from the reused prefix to the last message's content, then the
    RAG instruction."""
    prefix_ids: list[int]
    """The reused rows' ids, then the glue: the fusion's prefix."""
    question_ids: list[int]
    """The lead, the last message's content and the template's closing."""
    question_text: tuple[int, int]
    """The last message's content within question_ids."""
    shared_prefix: bool
    """Nothing is reused and the prefix is the engine's shared chunk prefix: fuse after its
    cache instead of prefilling it."""
    at: int
    """The conversation token the chunks are spliced in before (the context's Insertion)."""
    spliced_ids: int
    """Rows of the splice besides the chunks: the RAG instruction and the lead."""

    @property
    def chunk_rows(self) -> int:
        return sum(chunk.token_end - chunk.token_start for _, chunk, _ in self.chunks)

    def insertion(self, document_rows: int) -> Insertion:
        """What the turn's context records of the splice, once the chunks took `document_rows` rows."""
        hashes = tuple(chunk.chunk_hash for _, chunk, _ in self.chunks)
        return Insertion(self.at, self.spliced_ids + document_rows, hashes)


@dataclass(frozen=True)
class FusePassages:
    """Fuse the passages pasted into the new tokens (ragkv.app.passages)."""

    ids: list[int]
    """The prompt's rows: the reused ones, then the conversation past them."""
    start: int
    """The first new row (the reused rows before it)."""
    passages: PassagePlan


@dataclass(frozen=True)
class Save:
    """What the turn leaves once answered."""

    context_id: str
    session: bool
    """Kept as the named session (its checkout released with the new context); else put as
    an anonymous context, a held base released empty."""
    turns: int
    created: float | None
    """The held base's creation time, kept; None: a new context, created when saved."""


@dataclass(frozen=True)
class TurnPlan:
    conversation: Conversation
    base: Base
    reuse: Reuse
    work: PrefillTail | FuseChunks | FusePassages
    save: Save

    @property
    def new_chunks(self) -> int:
        return len(self.work.chunks) if isinstance(self.work, FuseChunks) else 0


def user_messages(messages: list[dict[str, str]]) -> int:
    return sum(m["role"] == "user" for m in messages)


def session_opening(prompt: ChatPrompt, fingerprint: str, context: Context, messages: list[dict[str, str]]) -> Opening:
    """A turn on a checked-out session: only the new message continues the session's own ids
    (once it has turns); a whole history is rendered and shares what prefix it shares.
    Another model's rows are not reused (the session keeps them until the turn succeeds)."""
    held_ids = context.conversation_ids if context.fingerprint == fingerprint else []
    only_new_message = all(m["role"] != "assistant" for m in messages)
    if only_new_message and context.turns and held_ids:
        conversation = continue_conversation(prompt, held_ids, messages[-1]["content"])
        number = context.turns + 1
    else:
        conversation = render_conversation(prompt, messages)
        number = user_messages(messages)
    return Opening(conversation, Base(context, common_prefix(held_ids, conversation.token_ids), True), number)


def plan_turn(
    opening: Opening,
    retrieved: list,
    ids: TurnIds | None,
    *,
    lookup: PassageLookup | None,
    context_id: str,
    session: bool,
) -> TurnPlan:
    """The plan of a turn that opened as `opening` and retrieved `retrieved`; `ids` are
    what a chunk fusion splices in (needed only when chunks were retrieved); `lookup` finds
    pasted passages (None: the server or the turn does not reuse them)."""
    conversation, base = opening.conversation, opening.base
    context = base.context
    new = new_chunks(retrieved, context.chunks_before(base.matched_tokens) if context is not None else set())
    reused = base.matched_tokens
    if new:
        reused = min(reused, conversation.question_start)
    reused = min(reused, len(conversation.token_ids) - 1)
    if reused and not reusable(context, reused, bool(new)):
        reused = 0  # recomputed: the base's chunks are not in the prompt then, so all are new
        new = new_chunks(retrieved, set())
    reuse = _reuse(context, reused)
    if new:
        if ids is None:
            raise ValueError("a turn that retrieved chunks needs the ids a fusion splices in")
        work = _fuse_chunks(conversation, reuse, new, ids)
    else:
        work = _passages(conversation, reuse, context, lookup) or PrefillTail(conversation.token_ids[reused:])
    created = context.created if context is not None and base.held else None
    return TurnPlan(conversation, base, reuse, work, Save(context_id, session, opening.number, created))


def reusable(context: Context, conversation_tokens: int, fusing: bool) -> bool:
    """Whether the context's rows for `conversation_tokens` tokens can be read. A cache whose
    sliding-window layers released rows (in decode) serves a turn that appends to it, but
    not a cut before its window nor a fusion (which reads every layer's prefix rows)."""
    cache = context.cache
    if not cache.trimmed:
        return True
    rows = context.rows_for(conversation_tokens)
    return not fusing and (rows == cache.length or rows >= cache.earliest_cut)


def _reuse(context: Context | None, conversation_tokens: int) -> Reuse:
    if context is None or conversation_tokens == 0:
        return Reuse(0, [], [])
    rows = context.rows_for(conversation_tokens)
    insertions = [i for i in context.insertions if i.at < conversation_tokens]
    return Reuse(conversation_tokens, context.row_ids[:rows], insertions)


def _fuse_chunks(conversation: Conversation, reuse: Reuse, chunks: list, ids: TurnIds) -> FuseChunks:
    question_start = conversation.question_start
    glue = conversation.token_ids[reuse.conversation_tokens : question_start] + ids.instruction
    prefix_ids = reuse.row_ids + glue
    question_ids = ids.lead + conversation.token_ids[question_start:]
    question_text = (len(ids.lead), len(ids.lead) + conversation.question_end - question_start)
    shared_prefix = reuse.rows == 0 and prefix_ids == ids.chunk_prefix
    spliced = len(ids.instruction) + len(ids.lead)
    return FuseChunks(chunks, glue, prefix_ids, question_ids, question_text, shared_prefix, question_start, spliced)


def _passages(
    conversation: Conversation, reuse: Reuse, context: Context | None, lookup: PassageLookup | None
) -> FusePassages | None:
    """The passages among the new tokens, when the turn looks for them."""
    if lookup is None:
        return None
    if context is not None and context.cache.trimmed:
        return None  # a fusion reads every layer's prefix rows, which released windows lack
    ids = reuse.row_ids + conversation.token_ids[reuse.conversation_tokens :]
    passages = lookup(ids, reuse.rows)
    return None if passages is None else FusePassages(ids, reuse.rows, passages)


def new_chunks(retrieved: list, held: set[str]) -> list:
    """The retrieved (record, chunk, score) whose chunk is not in `held`, each chunk once."""
    return list(
        {
            chunk.chunk_hash: (record, chunk, score)
            for record, chunk, score in retrieved
            if chunk.chunk_hash not in held
        }.values()
    )
