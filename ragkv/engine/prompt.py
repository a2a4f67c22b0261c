"""Prompt layout from the model's chat template.

A RAG prompt is [prefix | chunk 1 ... chunk k | question]: the prefix holds the template's
opening (system turn, start of the user turn, an instruction), the question segment holds
the question and the template's closing (end of user turn, start of the assistant turn).
Both are found by rendering the template around a sentinel, so any chat template works.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using the documents given."
RAG_INSTRUCTION = "Documents:\n"
_SENTINEL = "\u2063RAGKV-SENTINEL\u2063"


@dataclass(frozen=True)
class RagSegments:
    prefix_ids: list[int]
    question_ids: list[int]
    question_text_span: tuple[int, int]
    """[start, end) of the question's own tokens inside question_ids."""


class ChatPrompt:
    def __init__(self, tokenizer, system_prompt: str = DEFAULT_SYSTEM_PROMPT):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        rendered = self.render([{"role": "user", "content": _SENTINEL}])
        if rendered.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not render the user message exactly once")
        self._before_user, self._after_user = rendered.split(_SENTINEL)
        self._prefix_ids = self.encode(self._before_user + RAG_INSTRUCTION)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def render(self, messages: list[dict[str, str]]) -> str:
        """Messages rendered with the chat template, the system prompt added when absent,
        ending with the assistant turn's opening."""
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        if self.tokenizer.chat_template is None:
            # a base model (Gemma 3 270M's GGUF has no template): plain turns, opened by BOS
            # where the tokenizer adds one itself, since templates write it and Gemma's
            # outputs are garbage without it
            body = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return self._bos_text() + body + "assistant: "
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _bos_text(self) -> str:
        bos = self.tokenizer.bos_token_id
        adds_bos = bos is not None and bos in self.tokenizer("")["input_ids"]
        return self.tokenizer.bos_token if adds_bos else ""

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.render(messages))

    @property
    def prefix_ids(self) -> list[int]:
        """The RAG prefix segment; chunks may be precomputed after it (see ChunkEncoder)."""
        return list(self._prefix_ids)

    def rag_segments(self, question: str) -> RagSegments:
        lead = self.encode("\n\nQuestion: ")
        words = self.encode(question.strip())
        closing = self.encode(self._after_user)
        return RagSegments(self.prefix_ids, lead + words + closing, (len(lead), len(lead) + len(words)))

    def turn_ids(self, user_message: str, previous_answer: str | None) -> list[int]:
        """Tokens that extend a chat cache by one user turn: the previous answer (when there
        is one), the template's text between turns, and the new message up to the
        assistant turn's opening."""
        text = ""
        if previous_answer is not None:
            text += previous_answer + self.between_turns
        return self.encode(text + user_message.strip() + self._after_user)

    @property
    def closing(self) -> str:
        """Template text from the end of a user message to the start of the assistant's answer."""
        return self._after_user

    @property
    def between_turns(self) -> str:
        """Template text from the end of an assistant message to the start of the next user message."""
        answer, question = _SENTINEL + "A", _SENTINEL + "Q"
        rendered = self.render(
            [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": question},
            ]
        )
        return rendered[rendered.index(answer) + len(answer) : rendered.index(question)]
