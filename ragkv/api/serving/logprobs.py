"""OpenAI's two shapes of `logprobs` from the tokens' TokenLogprob entries (app.logprobs)."""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.api.protocol.chat import ChatLogprobs, TokenLogprob, TopLogprob
from ragkv.api.protocol.completions import CompletionLogprobs
from ragkv.app.logprobs import TokenLogprob as AppTokenLogprob


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8", "surrogatepass")))


def chat_logprobs(entries: Sequence[AppTokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            TokenLogprob(**_top(e.text, e.logprob).model_dump(), top_logprobs=[_top(a.text, a.logprob) for a in e.top])
            for e in entries
        ]
    )


def completion_logprobs(entries: Sequence[AppTokenLogprob], text_offset: int = 0) -> CompletionLogprobs:
    """`text_offset`: characters of the completion before the first entry (streamed chunks)."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.text)
    return CompletionLogprobs(
        tokens=[e.text for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{a.text: a.logprob for a in e.top} for e in entries],
        text_offset=offsets,
    )
