"""What a selector may look at when it is built: the prompt's cache right after the
prefill or fusion (before the first decode step), and where each piece of the prompt sits.

Row j of the cache holds position j here (eviction, which breaks that, happens after the
selectors are built and is tracked by :class:`RowPositions`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM


@dataclass
class PromptState:
    model: CausalLM
    cache: KVCache
    token_ids: torch.Tensor
    """[T] the prompt's token ids (row j = position j)."""
    prefix_len: int
    question_start: int
    """Rows [question_start, T) are the question window (SnapKV, LRQK's query sample)."""
    chunk_spans: Sequence[tuple[int, int]] = ()
    chunk_codes: Sequence[torch.Tensor | None] = ()
    """Per chunk, A2ATS codes [layers, kv_heads, n] of its stored pre-RoPE keys under the
    active codebook, or None (then they are computed from the cache)."""
    recomputed_rows: Callable[[int], torch.Tensor] | None = None
    """Rows whose K/V at a layer were computed for this prompt; None = every row (plain prefill)."""
    _queries: list[torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        length = self.cache.length
        if self.token_ids.numel() != length or self.cache.next_position != length:
            raise ValueError("the prompt state needs an un-evicted cache whose rows are the prompt's positions")
        if not 0 <= self.prefix_len <= self.question_start < length:
            raise ValueError("need 0 <= prefix_len <= question_start < length")
        if len(self.chunk_codes) not in (0, len(self.chunk_spans)):
            raise ValueError("chunk_codes must be empty or one entry per chunk span")

    @property
    def length(self) -> int:
        return self.cache.length

    @classmethod
    def from_prefill(
        cls, model: CausalLM, cache: KVCache, token_ids, prefix_len: int = 0, question_start: int | None = None
    ) -> PromptState:
        """A plain prefill: every row computed fresh; the question window defaults to the last row."""
        ids = torch.as_tensor(token_ids).flatten()
        start = ids.numel() - 1 if question_start is None else question_start
        return cls(model, cache, ids, prefix_len, start)

    @classmethod
    def from_fusion(cls, model: CausalLM, result, chunk_codes: Sequence[torch.Tensor | None] = ()) -> PromptState:
        """A fused prompt (ragkv.fusion.FusionResult): rows a layer did not recompute may use stored codes."""
        layout = result.layout
        return cls(
            model,
            result.cache,
            layout.token_ids,
            layout.prefix_len,
            layout.question_start,
            list(layout.chunk_spans),
            list(chunk_codes),
            result.recomputed_rows,
        )

    def question_queries(self) -> list[torch.Tensor]:
        """Post-RoPE queries [Hq, Nq, D] of the question rows at every layer (computed once).

        The question rows are re-run from layer 0 against the cache. Every prefill and
        fusion strategy computes the question rows fresh at every layer and writes their
        K/V before they attend, so this reproduces exactly the queries it had (the cache
        is read, never written).
        """
        if self._queries is None:
            self._queries = probe_queries(
                self.model, self.cache, self.token_ids, torch.arange(self.question_start, self.length)
            )
        return self._queries


@torch.inference_mode()
def probe_queries(model: CausalLM, cache: KVCache, token_ids: torch.Tensor, rows: torch.Tensor) -> list[torch.Tensor]:
    """Queries of `rows` (positions) at every layer, attending to the cache's valid rows."""
    rows = rows.to(model.device)
    hidden = model.embed(token_ids.to(model.device)[rows])
    queries = []
    for layer in range(model.spec.num_layers):
        projection = model.project(layer, hidden, rows)
        queries.append(projection.q)
        if layer + 1 < model.spec.num_layers:
            hidden = model.finish_layer(layer, hidden, model.attend(layer, projection, rows, cache, cache.length))
    return queries


class RowPositions:
    """The RoPE position of every cache row, per layer and KV head.

    Identity until SnapKV compacts the cache; after that the kept rows keep the
    positions they were computed at, and rows appended later continue from the cache's
    `next_position` (the same for every head).
    """

    def __init__(self, rows: int):
        self.base_rows = rows
        self.base_position = rows
        self.table: torch.Tensor | None = None  # [layers, kv_heads, base_rows] after eviction

    def compact(self, kept: torch.Tensor, next_position: int) -> None:
        """`kept` [layers, kv_heads, C]: the old rows each compacted row came from."""
        old = kept if self.table is None else torch.gather(self.table, 2, kept)
        self.table = old
        self.base_rows = kept.shape[2]
        self.base_position = next_position

    def of(self, layer: int, start: int, end: int, kv_heads: int) -> torch.Tensor:
        """Positions [kv_heads, end - start] of rows [start, end)."""
        rows = torch.arange(start, end)
        if self.table is None:
            return rows.expand(kv_heads, -1)
        positions = self.base_position + (rows - self.base_rows)
        positions = positions.expand(kv_heads, -1).clone()
        inside = min(end, self.base_rows)
        if start < inside:
            positions[:, : inside - start] = self.table[layer, :, start:inside]
        return positions


def unrotate_keys(model: CausalLM, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys [Hkv, n, D] from post-RoPE `keys` at `positions` [Hkv, n] (or [n])."""
    hkv, n, d = keys.shape
    if positions.dim() == 1:
        positions = positions.expand(hkv, n)
    cos, sin = model.rotary.cos_sin(-positions.reshape(-1).to(model.device))
    cos, sin = cos.view(hkv, n, d), sin.view(hkv, n, d)
    x1, x2 = keys.chunk(2, dim=-1)
    rotated = keys * cos + torch.cat((-x2, x1), dim=-1) * sin
    scaling = model.rotary.attention_scaling
    return rotated / (scaling * scaling) if scaling != 1.0 else rotated
