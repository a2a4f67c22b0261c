"""POST /v1/chat/completions, /v1/models and /v1/sessions bodies from application types."""

from __future__ import annotations

from ragkv.api.protocol.chat import (
    ChatChoice,
    ChatCompletion,
    ChatMessageOut,
    FusionDefault,
    Model,
    SessionList,
    SessionSummary,
)
from ragkv.api.serving.common import openai_finish_reason, openai_usage_of, rag_extension_of
from ragkv.api.serving.logprobs import chat_logprobs
from ragkv.app.contexts import Context
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
        fusion=FusionDefault(strategy=fusion.strategy, ratio=fusion.ratio, calibrated=fusion.calibrated)
        if fusion is not None
        else None,
    )


def session_list(contexts: list[Context]) -> SessionList:
    return SessionList(data=[SessionSummary.model_validate(context.summary()) for context in contexts])
