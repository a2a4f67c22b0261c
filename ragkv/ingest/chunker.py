"""Cutting a document into fixed-size token chunks, keeping each chunk's text span."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class Chunk:
    index: int
    token_ids: list[int]
    char_start: int
    char_end: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def chunk_document(tokenizer, text: str, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[Chunk]:
    """Tokenise `text` once and cut it every `chunk_tokens` tokens. The last chunk may be
    shorter. Spans come from the fast tokenizer's offsets, so a citation can show the
    exact text a chunk covers."""
    if chunk_tokens < 16:
        raise ValueError(f"chunk_tokens must be at least 16, got {chunk_tokens}")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    chunks = []
    for index, start in enumerate(range(0, len(ids), chunk_tokens)):
        end = min(start + chunk_tokens, len(ids))
        chunks.append(Chunk(index, ids[start:end], offsets[start][0], offsets[end - 1][1]))
    return chunks
