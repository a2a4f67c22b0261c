"""Retrieval-based sparse decode attention: the shared procedure (template method).

Every decode step, per layer and per KV head:
  1. the first `sinks` rows and the last `window` rows (plus a selector's extra recent
     rows) are always attended exactly;
  2. the selector scores the rows in between and keeps the top k, where k is what the
     budget (see :mod:`ragkv.sparse.config`: it counts every attended row) leaves;
  3. exact attention runs over the chosen rows with kernels.sparse_decode_attention.

GQA: selection is per KV head, shared by its query heads, and aggregates the heads by a
SUM. With head_aggregation='probs' (the default of every selector but a2ats) what is
summed is each query head's estimated attention probability: its approximate logits over
the candidates, normalised together
with the exact logits of the sinks and window rows. The oracle sums the exact
probabilities, which makes it the mass-optimal choice the recall metric is measured
against. head_aggregation='logits' sums the raw approximate logits instead (equivalent to
scoring the group-summed query; cheaper, less accurate; a2ats's default, where on the
CPU it is what makes sparse decode pay).

A selector is a per-request object (built on a :class:`PromptState`). Per-row state
(codes, low-rank key factors) lives in :class:`RowBuffer` s: built for the prompt's rows,
extended as decoded rows leave the recent window (EXTEND_BATCH rows at a time; until
then they stay exact, inside the budget), and compacted with the cache when SnapKV
evicts rows.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.kernels import sparse_decode_attention
from ragkv.kernels.torch_cpu import gather_rows
from ragkv.sparse.prompt import PromptState, RowPositions

if TYPE_CHECKING:  # config.py imports the registry, which imports every selector module
    from ragkv.sparse.config import SparseConfig

EXTEND_BATCH = 16
"""Decoded rows get their per-row state (codes, factors) this many at a time."""

Observer = Callable[[int, torch.Tensor, KVCache, torch.Tensor, int, int], None]
"""Called as (layer, q, cache, indices [Hkv, K], start, end) on every step (benchmarks)."""


class RowBuffer:
    """Per-row state [layers, kv_heads, rows, *trailing] that grows by doubling."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def ensure(self, rows: int) -> None:
        capacity = self.data.shape[2]
        if rows > capacity:
            grown = self.data.new_zeros(self.data.shape[:2] + (max(rows, 2 * capacity),) + self.data.shape[3:])
            grown[:, :, :capacity] = self.data
            self.data = grown

    def write(self, layer: int, start: int, values: torch.Tensor) -> None:
        """values [kv_heads, n, *trailing] into rows [start, start + n) of `layer`."""
        self.ensure(start + values.shape[1])
        self.data[layer, :, start : start + values.shape[1]] = values

    def rows(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.data[layer, :, start:end]

    def compact(self, kept: torch.Tensor) -> None:
        """Keep rows `kept` [layers, kv_heads, C] in that order."""
        index = kept.view(kept.shape + (1,) * (self.data.dim() - 3)).expand(kept.shape + self.data.shape[3:])
        self.data = torch.gather(self.data, 2, index.to(self.data.device))

    @property
    def bytes_per_row(self) -> int:
        """Bytes one row costs over all layers and KV heads."""
        trailing = 1
        for size in self.data.shape[3:]:
            trailing *= size
        return self.data.shape[0] * self.data.shape[1] * trailing * self.data.element_size()


@dataclass(frozen=True)
class SelectorOptions:
    """A selector's own settings, the dataclass a spec string builds (ragkv.sparse.registry);
    subclasses add fields and validate them in __post_init__. The Selector class that runs
    them names them once, `class X(Selector, options=XOptions)`, and `attach` builds it."""

    name: ClassVar[str] = ""
    default_head_aggregation: ClassVar[str] = "probs"
    """SparseConfig.head_aggregation when a request leaves it unset."""
    needs_codebook: ClassVar[bool] = False
    """The selector scores rows through the engine's A2ATS codebook: a request is refused
    without one, and the query path hands it every chunk's codes under it."""
    selector: ClassVar[type[Selector]]
    """The per-request class these options configure (set by its `options=` class keyword)."""

    def attach(self, config: SparseConfig, prompt: PromptState, codebook) -> Selector:
        """The per-request Selector for `prompt` under `config` (whose options are these)."""
        return self.selector(config, prompt, codebook)


class Selector(ABC):
    """One way to score cache rows for a decode query. Subclasses write only their state
    and their `select`; this class owns budget, sinks/window, bookkeeping and attention."""

    extra_recent: int = 0
    """Rows beyond the common window this selector always keeps exact (LRQK's lite set)."""

    def __init_subclass__(cls, options: type[SelectorOptions] | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if options is not None:
            options.selector = cls

    def __init__(self, config: SparseConfig, prompt: PromptState, codebook=None):
        self.config = config
        self.options = config.options
        self.name = config.name
        self.model = prompt.model
        self.spec = prompt.model.spec
        self.positions = RowPositions(prompt.length)
        self.buffers: list[RowBuffer] = []
        self.ready = [prompt.length] * self.spec.num_layers
        """Per layer: rows [0, ready) have per-row state."""
        self.observer: Observer | None = None
        self.prepare(prompt, codebook)

    # -- what selectors define ------------------------------------------------------------

    def prepare(self, prompt: PromptState, codebook) -> None:
        """Build per-request state for the prompt's rows (default: none)."""

    def extend(self, layer: int, cache: KVCache, start: int, end: int) -> None:
        """Per-row state for rows [start, end) of `layer`, decoded after the prompt."""

    def head_scores(self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int) -> torch.Tensor:
        """Approximate attention logits (scaled like the real ones) [Hkv, G, end - start]
        of every query head for rows [start, end)."""
        raise NotImplementedError(f"{self.name} defines no head_scores")

    def select(self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int, k: int) -> torch.Tensor:
        """The k rows [Hkv, k] (absolute, int64) of [start, end) to attend, for query q [Hq, 1, D]:
        the top k of the head-aggregated `head_scores` (subclasses may override)."""
        scores = self.head_scores(layer, q, cache, start, end)
        if self.config.aggregation == "logits":
            return top_rows(scores.sum(1), k, start)
        keys, _ = cache.layer(layer)
        fixed = torch.cat((keys[:, :start], keys[:, end:]), dim=1).float()
        exact = torch.bmm(q[:, 0].reshape(*scores.shape[:2], -1).float(), fixed.transpose(1, 2)).mul_(self.model.scale)
        return top_rows(probability_mass(scores, exact), k, start)

    def exact_rerank(
        self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int, candidates: torch.Tensor, k: int
    ) -> torch.Tensor:
        """The k of `candidates` [Hkv, c] (absolute rows) with the most exact attention mass,
        summed over the group like the oracle (the candidates' exact logits, normalised with
        the always-attended rows [0, start) and [end, rows)); reads the candidates' keys."""
        keys, _ = cache.layer(layer)
        heads = candidates.shape[0]
        query = q[:, 0].reshape(heads, -1, q.shape[-1]).float()
        logits = torch.bmm(query, gather_rows(keys, candidates).float().transpose(1, 2)).mul_(self.model.scale)
        fixed = torch.cat((keys[:, :start], keys[:, end:]), dim=1).float()
        exact = torch.bmm(query, fixed.transpose(1, 2)).mul_(self.model.scale)
        best = probability_mass(logits, exact).topk(k, dim=-1, sorted=False).indices
        return torch.gather(candidates, 1, best)

    @property
    def fixed_bytes(self) -> int:
        """Auxiliary bytes that do not grow with the context (codebooks, factors)."""
        return 0

    # -- the shared procedure ----------------------------------------------------------

    @property
    def aux_bytes_per_token(self) -> int:
        """Auxiliary bytes per cached token over all layers and KV heads, as held."""
        return sum(buffer.bytes_per_row for buffer in self.buffers)

    def compact(self, kept: torch.Tensor, next_position: int) -> None:
        """Follow a cache compaction: row i of every layer/head is old row kept[l, h, i]."""
        for buffer in self.buffers:
            buffer.compact(kept)
        self.positions.compact(kept, next_position)
        self.ready = [kept.shape[2]] * self.spec.num_layers

    def span(self, rows: int) -> tuple[int, int, int]:
        """(start, end, k): rows [start, end) are scored and k of them kept."""
        head = min(self.config.sinks, rows)
        tail = min(self.config.window + self.extra_recent, rows - head)
        start, end = head, rows - tail
        k = min(max(self.config.budget_rows(rows) - head - tail, 0), end - start)
        return start, end, k

    def step_span(self, layer: int, cache: KVCache) -> tuple[int, int, int]:
        """(start, end, k) of this step at `layer`: rows [start, end) are scored and k of
        them kept. Rows that left the window get their per-row state here, EXTEND_BATCH at
        a time; until then they stay exact a little longer, inside the budget."""
        rows = cache.length
        start, end, k = self.span(rows)
        ready = self.ready[layer]
        if k == end - start or end <= ready:
            return start, end, k
        if end - ready >= EXTEND_BATCH or ready <= start:
            self.extend(layer, cache, ready, end)
            self.ready[layer] = end
            return start, end, k
        k = min(max(self.config.budget_rows(rows) - start - (rows - ready), 0), ready - start)
        return start, ready, k

    def indices(self, layer: int, q: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, int, int]:
        rows, heads = cache.length, self.spec.num_kv_heads
        start, end, k = self.step_span(layer, cache)
        if k == end - start:
            return torch.arange(rows, device=q.device).expand(heads, rows), start, end
        parts = [torch.arange(start, device=q.device).expand(heads, start)]
        if k:
            parts.append(self.select(layer, q, cache, start, end, k).to(q.device))
        parts.append(torch.arange(end, rows, device=q.device).expand(heads, rows - end))
        return torch.cat(parts, dim=1), start, end

    def compiled_plan(self, cache: KVCache):
        """This step's state for the compiled decode step, or None where this selector runs
        the Python loop (the default)."""
        return None

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, scale: float) -> torch.Tensor:
        indices, start, end = self.indices(layer, q, cache)
        if self.observer is not None:
            self.observer(layer, q, cache, indices, start, end)
        keys, values = cache.layer(layer)
        out = sparse_decode_attention(q[:, 0], keys, values, indices, scale, backend=self.config.backend)
        return out.unsqueeze(1)

    # -- helpers for subclasses ------------------------------------------------------------

    def group_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [Hq, 1, D] -> the sum of each KV head's query heads [Hkv, D] (the GQA aggregation)."""
        return q[:, 0].reshape(self.spec.num_kv_heads, self.spec.group_size, -1).sum(1)

    def current_position(self, cache: KVCache) -> int:
        """RoPE position of the token being decoded (decode_step advances next_position
        only after the last layer, so during attention it is the current token's)."""
        return cache.next_position


def probability_mass(scores: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Each query head's estimated attention probability of every candidate, summed over the
    KV head's group: [Hkv, n] from approximate logits `scores` [Hkv, G, n] (overwritten) and
    the exact logits `exact` [Hkv, G, f] of the always-attended rows, which join the
    softmax's normaliser. exp(s - lse) = exp(s - max) * exp(max - lse), so the sum over the
    group is one batched product with per-head weights exp(max - lse)."""
    peak = scores.amax(-1, keepdim=True)
    shifted = scores.sub_(peak).exp_()
    lse = torch.logaddexp(peak + shifted.sum(-1, keepdim=True).log(), torch.logsumexp(exact, -1, keepdim=True))
    return torch.bmm((peak - lse).exp_().transpose(1, 2), shifted).squeeze(1)


def top_rows(scores: torch.Tensor, k: int, start: int) -> torch.Tensor:
    """Absolute rows [Hkv, k] of the k largest scores [Hkv, n] of rows [start, start + n)."""
    return scores.topk(k, dim=-1, sorted=False).indices + start
