"""POST /v1/completions bodies from application types."""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.api.common.protocol import CachedTokens
from ragkv.api.common.serving import citations_of, openai_finish_reason
from ragkv.api.completions.protocol import (
    Completion,
    CompletionChoice,
    CompletionCitations,
    CompletionLogprobs,
    CompletionUsage,
)
from ragkv.api.streaming import StreamRenderer
from ragkv.app.logprobs import TokenLogprob as AppTokenLogprob
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


class CompletionAnswer:
    """The text_completion bodies of one request: the whole answer, or its stream (each chunk
    a Completion, as OpenAI sends them)."""

    def __init__(self, completion_id: str, created: int, model: str, with_citations: bool, logprobs: int | None):
        self.completion_id, self.created, self.model = completion_id, created, model
        self.with_citations = with_citations
        self.logprobs = logprobs

    def envelope(self, choices: list[CompletionChoice], usage: CompletionUsage | None = None) -> Completion:
        return Completion(id=self.completion_id, created=self.created, model=self.model, choices=choices, usage=usage)

    def citations(self, completion: RequestOutput) -> list | None:
        return completion.citations if self.with_citations else None

    def whole(self, completions: list[RequestOutput]) -> Completion:
        choices = [
            completion_choice(
                i,
                c.text,
                openai_finish_reason(c.finish_reason),
                self.citations(c),
                completion_logprobs(c.logprobs) if c.logprobs is not None else None,
            )
            for i, c in enumerate(completions)
        ]
        return self.envelope(choices, completion_usage(completions))


class CompletionStream(StreamRenderer):
    """A streamed completion: a chunk per piece of each prompt's answer, a last chunk per
    prompt with its finish reason, then the usage when asked for."""

    def __init__(self, answer: CompletionAnswer, include_usage: bool):
        self.answer = answer
        self.include_usage = include_usage
        self.pending: dict[int, list] = {}  # per prompt: logprob entries of tokens whose text is not sent yet
        self.offsets: dict[int, int] = {}  # per prompt: characters of the entries sent so far

    def logprobs_of(self, index: int) -> CompletionLogprobs | None:
        entries = self.pending.pop(index, [])
        if self.answer.logprobs is None or not entries:
            return None
        out = completion_logprobs(entries, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + sum(len(e.text) for e in entries)
        return out

    def render(self, event) -> list[Completion]:
        if event.kind == "logprob":
            self.pending.setdefault(event.index, []).append(event.value)
        if event.kind != "token":
            return []
        return [
            self.answer.envelope(
                [completion_choice(event.index, event.value, None, logprobs=self.logprobs_of(event.index))]
            )
        ]

    def finish(self, completions: list[RequestOutput]) -> list[Completion]:
        events = [
            self.answer.envelope(
                [
                    completion_choice(
                        i,
                        "",
                        openai_finish_reason(c.finish_reason),
                        self.answer.citations(c),  # a stop string's tokens: never sent
                        logprobs=self.logprobs_of(i),
                    )
                ]
            )
            for i, c in enumerate(completions)
        ]
        if self.include_usage:
            events.append(self.answer.envelope([], completion_usage(completions)))
        return events
