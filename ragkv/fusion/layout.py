"""The fused prompt [prefix | chunk 1 ... chunk k | question] and where each piece sits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.kernels.kv_quant import QuantizedKV


@dataclass
class LoadedChunk:
    """A chunk as read from the store: token ids and pre-RoPE K/V [layers, kv_heads, T, D],
    float or integer-coded (dequantised when placed). Without K/V (`fresh`) the chunk's
    rows are computed for this request at every layer, in the context before them (a
    passage of a prompt not yet in the store, or the text between passages)."""

    token_ids: list[int]
    keys: torch.Tensor | QuantizedKV | None = None
    values: torch.Tensor | QuantizedKV | None = None

    def __post_init__(self) -> None:
        if (self.keys is None) != (self.values is None):
            raise ValueError("a chunk has both keys and values, or neither")
        if self.keys is not None and (
            tuple(self.keys.shape) != tuple(self.values.shape) or self.keys.shape[2] != len(self.token_ids)
        ):
            raise ValueError("chunk keys/values must be [layers, kv_heads, len(token_ids), head_dim]")

    @property
    def fresh(self) -> bool:
        return self.keys is None


@dataclass(frozen=True)
class FusionInput:
    prefix_ids: list[int]
    chunks: list[LoadedChunk]
    question_ids: list[int]
    chunk_precompute_offset: int = 0
    """Position of a chunk's first token when its KV was computed (the precompute prefix
    length); strategies that keep local positions (full_reuse) rotate keys to it."""
    question_text_span: tuple[int, int] | None = None
    """Where the question's own words sit inside question_ids (the rest is template)."""

    def __post_init__(self) -> None:
        if not self.question_ids:
            raise ValueError("the question segment is empty")


@dataclass(frozen=True)
class Layout:
    """Row positions of each segment in the fused cache (row j = position j)."""

    token_ids: torch.Tensor
    prefix_len: int
    chunk_spans: list[tuple[int, int]]
    question_start: int
    question_text_span: tuple[int, int] | None = None
    fresh_chunks: tuple[int, ...] = ()
    """Chunks without stored K/V: their rows are computed at every layer."""

    @classmethod
    def of(cls, fusion_input: FusionInput) -> Layout:
        ids = list(fusion_input.prefix_ids)
        spans = []
        for chunk in fusion_input.chunks:
            spans.append((len(ids), len(ids) + len(chunk.token_ids)))
            ids.extend(chunk.token_ids)
        question_start = len(ids)
        ids.extend(fusion_input.question_ids)
        fresh = tuple(i for i, chunk in enumerate(fusion_input.chunks) if chunk.fresh)
        return cls(
            torch.tensor(ids),
            len(fusion_input.prefix_ids),
            spans,
            question_start,
            fusion_input.question_text_span,
            fresh,
        )

    @property
    def fresh_rows(self) -> torch.Tensor:
        """Rows of the fresh chunks, ascending (empty when every chunk was stored)."""
        if not self.fresh_chunks:
            return torch.empty(0, dtype=torch.long)
        return torch.cat([torch.arange(*self.chunk_spans[i]) for i in self.fresh_chunks])

    @property
    def num_reused_document_tokens(self) -> int:
        return self.num_document_tokens - sum(
            self.chunk_spans[i][1] - self.chunk_spans[i][0] for i in self.fresh_chunks
        )

    @property
    def reused_document_rows(self) -> torch.Tensor:
        """Document rows whose K/V is placed from the store (a selection chooses among them)."""
        rows = self.document_rows
        if not self.fresh_chunks:
            return rows
        return rows[~torch.isin(rows, self.fresh_rows)]

    @property
    def length(self) -> int:
        return self.token_ids.numel()

    @property
    def document_rows(self) -> torch.Tensor:
        """Rows of chunk tokens (between the prefix and the question)."""
        return torch.arange(self.prefix_len, self.question_start)

    @property
    def question_rows(self) -> torch.Tensor:
        return torch.arange(self.question_start, self.length)

    @property
    def num_document_tokens(self) -> int:
        return self.question_start - self.prefix_len
