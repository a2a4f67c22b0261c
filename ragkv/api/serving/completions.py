"""POST /v1/completions and POST /v1/embeddings bodies from application types."""

from __future__ import annotations

import base64
from collections.abc import Sequence

from ragkv.api.protocol.common import CachedTokens
from ragkv.api.protocol.completions import (
    CompletionChoice,
    CompletionCitations,
    CompletionLogprobs,
    CompletionUsage,
    Embedding,
    EmbeddingList,
    EmbeddingUsage,
)
from ragkv.api.serving.common import citations_of
from ragkv.app.request import RequestOutput


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    citations: list | None = None,
    logprobs: CompletionLogprobs | None = None,
) -> CompletionChoice:
    """`citations`: the application's, when the prompt was answered from documents."""
    rag = CompletionCitations(citations=citations_of(citations)) if citations is not None else None
    return CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs, rag=rag)


def completion_usage(completions: Sequence[RequestOutput]) -> CompletionUsage:
    prompt = sum(c.usage.prompt_tokens for c in completions)
    completion = sum(c.usage.completion_tokens for c in completions)
    cached = CachedTokens(cached_tokens=sum(c.usage.cached_tokens for c in completions))
    return CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=cached,
    )


def embedding_list(model: str, vectors: Sequence, tokens: int, base64_encoded: bool) -> EmbeddingList:
    """`vectors`: float32 arrays; `base64_encoded`: each as base64 of its little-endian bytes."""

    def encoded(vector) -> list[float] | str:
        if base64_encoded:
            return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return vector.tolist()

    return EmbeddingList(
        model=model,
        data=[Embedding(index=i, embedding=encoded(v)) for i, v in enumerate(vectors)],
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
