"""Citations, usage and the `rag` extension, as several endpoints send them."""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.api.common.protocol import CachedTokens, Citation, OpenAIUsage, RagExtension, SessionSummary, Usage
from ragkv.app.chat.turn import ChatInfo
from ragkv.app.rag import Citation as AppCitation
from ragkv.app.request import FinishReason, RequestOutput
from ragkv.app.usage import TokenUsage


def openai_finish_reason(reason: FinishReason) -> str:
    """OpenAI's finish_reason: it does not tell an end-of-sequence token from a stop string."""
    return "length" if reason is FinishReason.LENGTH else "stop"


def citation_of(citation: AppCitation) -> Citation:
    """The same fields by name, but the document's id (the application's `doc_id`)."""
    same = {name: getattr(citation, name) for name in Citation.model_fields if name != "document_id"}
    return Citation(document_id=citation.doc_id, **same)


def citations_of(citations: Sequence[AppCitation]) -> list[Citation]:
    return [citation_of(citation) for citation in citations]


def usage_of(usage: TokenUsage) -> Usage:
    return Usage.model_validate(usage, from_attributes=True)  # the same names, read as attributes


def openai_usage_of(usage: TokenUsage) -> OpenAIUsage:
    return OpenAIUsage(
        **usage_of(usage).model_dump(), prompt_tokens_details=CachedTokens(cached_tokens=usage.cached_tokens)
    )


def rag_extension_of(completion: RequestOutput, session_id: str) -> RagExtension:
    info = completion.info
    assert isinstance(info, ChatInfo), "a chat turn's completion carries ChatInfo"
    return RagExtension(
        session_id=session_id,
        turn=info.turn,
        strategy=completion.strategy,
        new_chunks=info.new_chunks,
        context_tokens=info.context_tokens,
        citations=citations_of(completion.citations),
        timings=completion.timings.to_dict(),
        session=SessionSummary.model_validate(info.session) if info.session else None,
    )
