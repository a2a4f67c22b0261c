"""POST /v1/chat/completions, /v1/models and /v1/sessions bodies from application types."""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.api.chat.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    FusionDefault,
    Model,
    SessionList,
    TokenLogprob,
    TopLogprob,
)
from ragkv.api.common.protocol import SessionSummary
from ragkv.api.common.serving import openai_finish_reason, openai_usage_of, rag_extension_of
from ragkv.api.sessions import ChatTurnAnswer
from ragkv.api.streaming import StreamRenderer
from ragkv.app.chat.contexts import Context
from ragkv.app.logprobs import TokenLogprob as AppTokenLogprob
from ragkv.app.request import RequestOutput
from ragkv.app.status import DefaultFusion


def chat_completion(
    completion_id: str, created: int, model: str, outcome: RequestOutput, content: str, session_id: str, logprobs: bool
) -> ChatCompletion:
    """`content`: the answer as sent (the text, with a sources block when asked for)."""
    return ChatCompletion(
        id=completion_id,
        created=created,
        model=model,
        choices=[
            ChatChoice(
                index=0,
                message=ChatMessageOut(role="assistant", content=content),
                finish_reason=openai_finish_reason(outcome.finish_reason),
                logprobs=chat_logprobs(outcome.logprobs) if logprobs and outcome.logprobs is not None else None,
            )
        ],
        usage=openai_usage_of(outcome.usage),
        session_id=session_id,
        rag=rag_extension_of(outcome, session_id),
    )


def model_entry(model_id: str, created: float, fusion: DefaultFusion | None) -> Model:
    return Model(
        id=model_id,
        created=int(created),
        owned_by="ragkv",
        fusion=FusionDefault(
            strategy=fusion.strategy,
            ratio=fusion.ratio,
            calibrated=fusion.calibrated,
            refresh_ratio=fusion.refresh_ratio,
        )
        if fusion is not None
        else None,
    )


def session_list(contexts: list[Context]) -> SessionList:
    return SessionList(data=[SessionSummary.model_validate(context.summary()) for context in contexts])


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8", "surrogatepass")))


def chat_logprobs(entries: Sequence[AppTokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            TokenLogprob(**_top(e.text, e.logprob).model_dump(), top_logprobs=[_top(a.text, a.logprob) for a in e.top])
            for e in entries
        ]
    )


class ChatStream(StreamRenderer):
    """The chunks of a streamed chat completion (ChatCompletionChunk): the role, the answer's
    pieces with their logprobs, the finish reason with the session and the `rag` extension,
    the usage when asked for."""

    def __init__(self, completion_id: str, created: int, model: str, turn: ChatTurnAnswer, include_usage: bool):
        self.completion_id, self.created, self.model = completion_id, created, model
        self.turn = turn
        self.include_usage = include_usage
        self.pending_logprobs: list = []  # entries of tokens whose text has not been sent yet

    def chunk(self, delta: ChatDelta, finish_reason: str | None = None, **extra) -> ChatCompletionChunk:
        logprobs = None
        if self.pending_logprobs and delta.content is not None:
            logprobs = chat_logprobs(self.pending_logprobs)
            self.pending_logprobs = []
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return ChatCompletionChunk(
            id=self.completion_id, created=self.created, model=self.model, choices=[choice], **extra
        )

    def opening(self, first) -> list[ChatCompletionChunk]:
        return [self.chunk(ChatDelta(role="assistant", content=""), session_id=self.turn.session_id)]

    def render(self, event) -> list[ChatCompletionChunk]:
        if event.kind == "logprob":
            self.pending_logprobs.append(event.value)
        return [self.chunk(ChatDelta(content=event.value))] if event.kind == "token" else []

    async def settle(self, completions: list[RequestOutput]) -> None:
        await self.turn.settle(completions[0])

    def finish(self, completions: list[RequestOutput]) -> list[ChatCompletionChunk]:
        [outcome] = completions
        session_id = self.turn.session_id
        events = [self.chunk(ChatDelta(content=self.turn.sources(outcome)))] if self.turn.with_sources else []
        if self.pending_logprobs:  # tokens of a stop string: never sent as text
            events.append(self.chunk(ChatDelta(content="")))
        reason = openai_finish_reason(outcome.finish_reason)
        events.append(self.chunk(ChatDelta(), reason, session_id=session_id, rag=rag_extension_of(outcome, session_id)))
        if self.include_usage:
            usage = openai_usage_of(outcome.usage)
            events.append(
                ChatCompletionChunk(
                    id=self.completion_id, created=self.created, model=self.model, choices=[], usage=usage
                )
            )
        return events
