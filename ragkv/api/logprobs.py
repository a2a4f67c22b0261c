"""OpenAI's two shapes of `logprobs` from the tokens' TokenLogprob entries (app.logprobs).

chat.completion    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
text_completion    {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
"""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.app.logprobs import TokenLogprob


def _item(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    return {
        "content": [
            {**_item(e.text, e.logprob), "top_logprobs": [_item(a.text, a.logprob) for a in e.top]} for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int = 0, with_top: bool = True) -> dict:
    """`text_offset`: characters of the completion before the first entry (streamed chunks)."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{a.text: a.logprob for a in e.top} for e in entries] if with_top else None,
        "text_offset": offsets,
    }
