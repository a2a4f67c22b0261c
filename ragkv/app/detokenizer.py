"""Incremental detokenization: each new token costs a decode of a few tokens, not of the
whole answer so far.

Like vLLM's and TGI's detokenizers, two offsets into the token list are kept: text of
tokens[prefix:read] was already returned; decoding tokens[prefix:] and dropping that
prefix's text yields the new text (decoding from a few tokens back keeps the spaces and
merges a tokenizer puts between tokens). Text that ends in an incomplete UTF-8 character
waits for the next token. Stop strings are found in the accumulated text; text that may
still become a stop string is held back.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""
        """Text of the tokens decoded so far (stop strings not yet cut)."""
        self._emitted = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return (text safe to show now, whether a stop string was reached)."""
        self.token_ids.append(token_id)
        before = self._decode(self.token_ids[self._prefix : self._read])
        after = self._decode(self.token_ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.token_ids)
        search_from = max(0, self._emitted - self._hold)
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at != -1:
                delta = self.text[self._emitted : at] if at > self._emitted else ""
                self._emitted = max(self._emitted, at)
                self.text = self.text[: self._emitted]
                return delta, True
        safe = len(self.text)
        for stop in self.stop:
            for keep in range(min(len(stop) - 1, safe - self._emitted), 0, -1):
                if self.text[safe - keep : safe] == stop[:keep]:
                    safe -= keep
                    break
        delta = self.text[self._emitted : safe]
        self._emitted = safe
        return delta, False

    def rest(self) -> str:
        """Text not returned yet (held back or an incomplete character), at the end."""
        tail = self._decode(self.token_ids[self._prefix :])[
            len(self._decode(self.token_ids[self._prefix : self._read])) :
        ]
        self.text += tail
        self._prefix = self._read = len(self.token_ids)
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta
