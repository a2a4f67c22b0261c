"""Chat messages as token ids, the way the model's chat template renders them.

Every message keeps its role (a user's system prompt replaces the default one). The ids
are the concatenation of the template's text pieces and of each user message's content,
tokenized separately, so the same history always gives the same ids and a longer history
starts with the ids of a shorter one: the property prefix matching relies on. Documents
are not part of these ids; a chat turn splices them in before the last user message's
content (see ragkv.app.chat.turn).
"""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.engine.prompt import ChatPrompt

_SENTINEL = "\u2063RAGKV-USER-{}\u2063"


@dataclass(frozen=True)
class Conversation:
    token_ids: list[int]
    question_start: int
    """Where the last user message's content starts in token_ids."""
    question_end: int
    """Where it ends; the template's closing (the assistant turn's opening) follows."""

    @property
    def question_ids(self) -> list[int]:
        return self.token_ids[self.question_start : self.question_end]


def render_conversation(prompt: ChatPrompt, messages: list[dict[str, str]]) -> Conversation:
    """`messages` end with a user message; roles are system, user or assistant."""
    contents = [m["content"] for m in messages if m["role"] == "user"]
    masked = []
    for message in messages:
        if message["role"] == "user":
            masked.append({"role": "user", "content": _SENTINEL.format(sum(m["role"] == "user" for m in masked))})
        else:
            masked.append(message)
    text = prompt.render(masked)
    ids: list[int] = []
    question_start = question_end = 0
    for index, content in enumerate(contents):
        sentinel = _SENTINEL.format(index)
        before, text = text.split(sentinel, 1)
        ids += prompt.encode(before)
        question_start = len(ids)
        ids += prompt.encode(content)
        question_end = len(ids)
    ids += prompt.encode(text)
    return Conversation(ids, question_start, question_end)


def continue_conversation(prompt: ChatPrompt, previous_ids: list[int], message: str) -> Conversation:
    """The ids of a conversation whose ids so far (ending inside the assistant's last answer)
    are `previous_ids`, continued by one user message."""
    ids = previous_ids + prompt.encode(prompt.between_turns)
    question_start = len(ids)
    ids += prompt.encode(message)
    question_end = len(ids)
    return Conversation(ids + prompt.encode(prompt.closing), question_start, question_end)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
