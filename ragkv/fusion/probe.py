"""`probe`: question-led selective recompute.

Before anything is recomputed, the question rows run through every layer over the placed
(reused) cache. At each layer it records how the question's attention, summed over its rows
and heads, spreads over the document tokens, and how the last row's does (that row
predicts the first token); each share is normalised to 1 per layer, so every layer has an
equal vote. The r·n document tokens with the highest score over all layers (question share
plus `last_row_weight` times last-row share) are then recomputed from layer 0 with the
question rows.

Against `a3`, whose check layer sees the question's attention at layer 1 only, and must
run every token through the layers below it to do so, the probe sees where the question
reads at every depth: closer to the full prefill at the same r, and faster than a3 at a
higher r (BENCHMARKS.md).

A chat follow-up brings a few new tokens after a long conversation. Fewer document tokens
than `min_rows` are recomputed whole (a 10% share of a 120-token chunk leaves the first
token far from the full prefill), and after a long prefix the recomputed document rows and
the selection pass read only the prefix's first rows and its last `prefix_window` rows,
the question rows every row: the fuse costs in proportion to what is new.

The question is not the answer: the answer's later tokens read rows the question did not
pick. With `refresh_ratio`, a few greedy draft tokens decoded over the fused cache choose
a further share of the rows left stale, recomputed in a second, smaller pass
(ragkv.fusion.answer_refresh).

The selection pass also gives the first token as the placed cache alone predicts it. With
`escalate_kl` set, when the recompute moves it further than that, the fuse recomputes up to
`escalate_ratio` of the document rows (ragkv.fusion.escalation): a question placed before
its passages needs it, since every passage row of its full prefill read that question.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM
from ragkv.fusion.base import FusionResult, FusionStrategy, Preview, check_ratio, ratio_budget, top_k_rows
from ragkv.fusion.layout import Layout

LAYER_AGGREGATIONS = ("sum", "max")
PROBABILITY_BYTES = 64 << 20
PREFIX_SINK_ROWS = 16
"""First rows of a long prefix the selection pass always reads (the template's opening and
the model's attention sinks) when `prefix_window` leaves out the middle of that prefix."""


@dataclass
class Probe(FusionStrategy):
    name = "probe"
    ratio: float = 0.1
    """r: fraction of document tokens recomputed (from layer 0)."""
    layer_aggregation: str = "sum"
    """How the layers' attention shares combine into a token's score: sum or max."""
    last_row_weight: float = 1.0
    """Weight of the last question row's own attention share beside the whole question's
    (0 = every question row alike)."""
    coverage: float = 0.0
    """Per-request budget: recompute the fewest tokens whose scores hold this share of the
    total score, when that is more than `ratio` (which then is the floor), up to
    `max_ratio`. A question whose attention spreads over many tokens gets more rows than
    one that reads a few; 0 = the fixed budget `ratio`."""
    max_ratio: float = 0.5
    """Ceiling of the per-request budget `coverage` sets."""
    min_rows: int = 128
    """Document rows recomputed at least (all of them when there are fewer): a follow-up
    that brings one short chunk into a long conversation recomputes all of it, and skips
    the selection pass."""
    prefix_window: int = 1024
    """Of a prefix longer than PREFIX_SINK_ROWS + `prefix_window` rows (a conversation a
    follow-up fuses new chunks into), the recomputed document rows and the selection pass
    read only its first PREFIX_SINK_ROWS and its last `prefix_window` rows; the question
    rows read every row. The cost of fusing a chunk then follows the chunk, not the
    conversation. 0 = every row."""
    refresh_ratio: float = 0.0
    """After the fuse, recompute this share of the document rows more, chosen among those
    left stale by where `draft_tokens` greedy draft tokens attend (ragkv.fusion.answer_refresh):
    the answer's later tokens read rows the question did not pick. 0 = no refresh."""
    draft_tokens: int = 32
    """Greedy draft tokens whose attention chooses the refreshed rows. They should span the
    answer's tokens that matter: a few drafts see only the answer's start, which reads
    about what the question reads, so their rows add little."""
    refresh_rerun: bool = False
    """Run the probe's own document rows again in the refresh pass, so they read the
    refreshed rows' new K/V instead of their stale one (their recompute is paid twice)."""
    escalate_kl: float = 0.0
    """When the recompute moved the first token's distribution by more than this KL (nats)
    from the one the selection pass saw over the placed cache, the answer leans on stale
    rows more than `ratio` mends: the fuse recomputes the top `escalate_ratio` of the
    document rows by the same scores, in one more pass (ragkv.fusion.escalation). A prompt
    whose question comes before its passages is one: every passage row of its full prefill
    read that question; 0.05, set on dev examples 0-4, tells such prompts from the others
    at ~6K tokens (BENCHMARKS.md). 0 = never, the default: shorter prompts of reordered
    passages move as far and would lose half their reuse."""
    escalate_ratio: float = 0.5
    """The document rows recomputed, in all, once escalated."""

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        if self.layer_aggregation not in LAYER_AGGREGATIONS:
            raise ValueError(f"layer_aggregation must be one of {LAYER_AGGREGATIONS}")
        if not self.last_row_weight >= 0.0:
            raise ValueError("last_row_weight must be >= 0")
        if not 0.0 <= self.coverage <= 1.0:
            raise ValueError(f"coverage must be in [0, 1], got {self.coverage}")
        check_ratio(self.max_ratio)
        if self.coverage and self.max_ratio < self.ratio:
            raise ValueError("max_ratio must be >= ratio")
        if self.min_rows < 0:
            raise ValueError(f"min_rows must be >= 0, got {self.min_rows}")
        if self.prefix_window < 0:
            raise ValueError(f"prefix_window must be >= 0, got {self.prefix_window}")
        if not 0.0 <= self.refresh_ratio <= 1.0:
            raise ValueError(f"refresh_ratio must be in [0, 1], got {self.refresh_ratio}")
        if self.draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {self.draft_tokens}")
        if not self.escalate_kl >= 0.0:
            raise ValueError(f"escalate_kl must be >= 0, got {self.escalate_kl}")
        if not 0.0 <= self.escalate_ratio <= 1.0:
            raise ValueError(f"escalate_ratio must be in [0, 1], got {self.escalate_ratio}")

    def rows_after_prompt(self) -> int:
        return self.draft_tokens if self.refresh_ratio else 0  # the answer refresh's drafts

    def after_fuse(self, model: CausalLM, result: FusionResult) -> FusionResult:
        # imported here: both reuse this module's attention pass
        from ragkv.fusion.answer_refresh import refresh_for_answer
        from ragkv.fusion.escalation import escalate_if_moved

        columns = self.document_columns(model, result.layout)
        if self.escalate_kl:
            result = escalate_if_moved(model, result, self.escalate_kl, self.escalate_ratio, columns)
        if not self.refresh_ratio:
            return result
        return refresh_for_answer(model, result, self.refresh_ratio, self.draft_tokens, columns, self.refresh_rerun)

    def initial_rows(self, layout: Layout) -> torch.Tensor:
        """The rows the probe runs (the question); `rows_for` adds the chosen documents'."""
        return layout.question_rows

    def document_columns(self, model: CausalLM, layout: Layout) -> torch.Tensor | None:
        columns = probe_columns(layout, self.prefix_window, model.spec.sliding_window)
        return None if columns is None else columns[columns < layout.question_start]

    def rows_for(
        self, model: CausalLM, cache: KVCache, layout: Layout, report: dict[str, float], preview: Preview
    ) -> torch.Tensor:
        candidates = layout.reused_document_rows
        if self.min_rows >= candidates.numel():  # every document row: nothing to choose
            report["attention_covered"] = report["recomputed_share"] = 1.0
            return torch.cat((layout.document_rows, self.initial_rows(layout)))
        columns = probe_columns(layout, self.prefix_window, model.spec.sliding_window)
        if layout.fresh_chunks:  # not computed yet: the pass reads only placed rows
            columns = torch.arange(layout.length) if columns is None else columns
            columns = columns[~torch.isin(columns, layout.fresh_rows)]
        question, last_row, logits = question_attention_by_layer(model, cache, layout, columns, self.escalate_kl > 0)
        preview.logits = logits
        preview.columns = columns
        shares = question + self.last_row_weight * last_row
        scores = shares.sum(dim=0) if self.layer_aggregation == "sum" else shares.max(dim=0).values
        preview.scores = scores
        chosen = top_k_rows(scores, self.budget(scores, layout))
        report["attention_covered"] = float(scores[chosen].sum() / scores.sum().clamp_min(1e-12))
        report["recomputed_share"] = chosen.numel() / max(1, candidates.numel())
        return torch.cat((candidates[chosen.cpu()], self.initial_rows(layout)))

    def budget(self, scores: torch.Tensor, layout: Layout) -> int:
        floor = max(ratio_budget(self.ratio, layout), min(self.min_rows, layout.num_reused_document_tokens))
        if not self.coverage:
            return floor
        ordered = scores.sort(descending=True).values.cumsum(0)
        needed = int((ordered < self.coverage * ordered[-1]).sum()) + 1 if ordered.numel() else 0
        return max(floor, min(needed, ratio_budget(self.max_ratio, layout)))


def probe_columns(layout: Layout, prefix_window: int, model_window: int | None) -> torch.Tensor | None:
    """The cache rows the selection pass reads (ascending), or None for every row: of a
    prefix longer than PREFIX_SINK_ROWS + `prefix_window`, its first PREFIX_SINK_ROWS and its
    last `prefix_window` rows (at least the model's sliding window, so a windowed layer sees
    what it would), then every document and question row."""
    if not prefix_window:
        return None
    window = max(prefix_window, model_window or 0)
    tail_start = layout.prefix_len - window
    if tail_start <= PREFIX_SINK_ROWS:
        return None
    return torch.cat((torch.arange(PREFIX_SINK_ROWS), torch.arange(tail_start, layout.length)))


@torch.inference_mode()
def question_attention_by_layer(
    model: CausalLM, cache: KVCache, layout: Layout, columns: torch.Tensor | None = None, with_logits: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Two [layers, document tokens] tensors: the share of the question rows' attention
    (summed over rows and heads) that each document token receives at each layer, and the
    same for the last question row alone, with the question run over the cache as placed
    (only its rows `columns` when given: ascending, holding every document and question row);
    and the last row's next-token logits there (None without `with_logits`: only the
    escalation reads them, and the LM head is not free). Writes the question rows' K/V into `cache`."""
    rows = layout.question_rows.to(model.device)
    ids = layout.token_ids.to(model.device)[rows]
    if not with_logits:
        return *attention_shares_by_layer(model, cache, layout, ids, rows, columns), None
    return attention_shares_by_layer(model, cache, layout, ids, rows, columns, with_logits=True)


def attention_shares_by_layer(
    model: CausalLM,
    cache: KVCache,
    layout: Layout,
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    columns: torch.Tensor | None = None,
    *,
    with_logits: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Run `token_ids` at cache rows `rows` (ascending, the last row last) through every
    layer over the cache up to the last row (only its rows `columns` when given), writing
    their K/V; per layer, the share of their attention, and of the last row's alone, that
    each document token of `layout` receives: two [layers, document tokens] tensors, and
    with `with_logits` the last row's next-token logits as a third."""
    length = int(rows[-1]) + 1
    hidden = model.embed(token_ids)
    positions = torch.arange(length, device=model.device) if columns is None else columns.to(model.device)
    document_columns = (positions >= layout.prefix_len) & (positions < layout.question_start)
    every_row, last_row = [], []
    for layer in range(model.spec.num_layers):
        projection = model.project(layer, hidden, rows)
        cache.keys[layer, :, rows] = projection.k
        cache.values[layer, :, rows] = projection.v
        keys, values = cache.layer(layer, length)
        if columns is not None:
            keys, values = keys[:, positions], values[:, positions]
        attention, mass, last_row_mass = attention_with_column_mass(
            projection.q, keys, values, rows, model.scale, model.spec.layer_window(layer), positions
        )
        for shares, column_mass in ((every_row, mass), (last_row, last_row_mass)):
            document = column_mass[document_columns]
            shares.append(document / document.sum().clamp_min(1e-12))
        if layer + 1 < model.spec.num_layers:
            hidden = model.finish_layer(layer, hidden, attention)
    shares = torch.stack(every_row), torch.stack(last_row)
    if not with_logits:
        return shares
    last = model.finish_layer(layer, hidden[-1:], attention[:, -1:])  # only the last row's output is read
    return *shares, model.logits(last)[0]


def attention_with_column_mass(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    column_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention of q [Hq, N, D] at `positions` over keys/values [Hkv, T, D] (row j
    at position j, or at `column_positions[j]` when given: ascending), in float32; the
    attention each cache row receives summed over the rows and heads of q [T]; and the same
    for the last row of q alone [T]. The probabilities are materialised for a block of rows
    at a time (PROBABILITY_BYTES at most), so a long question (a chat turn's history) costs
    time, not memory. With `window` (a sliding-window layer) a row at p sees only rows
    p - window + 1 .. p, as the model's attention does."""
    heads, rows, dim = q.shape
    kv_heads, length = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    keys_t, values = keys.float().transpose(1, 2), values.float()
    block = max(1, PROBABILITY_BYTES // (4 * heads * length))
    attention = torch.empty(heads, rows, dim, dtype=torch.float32, device=q.device)
    mass = torch.zeros(length, dtype=torch.float32, device=q.device)
    columns = torch.arange(length, device=q.device) if column_positions is None else column_positions
    for first in range(0, rows, block):
        end = min(rows, first + block)
        # query head h reads KV head h // group: a KV head's group of heads is one GEMM;
        # the scale goes on the queries, the smaller operand
        grouped = (q[:, first:end].float() * scale).reshape(kv_heads, group * (end - first), dim)
        logits = torch.matmul(grouped, keys_t)
        row_positions = positions[first:end].repeat(group)[:, None]
        # columns ascend: without a window only those past the block's first row can be hidden
        start = 0 if window is not None else int(torch.searchsorted(columns, positions[first:end].min(), right=True))
        hidden_columns = columns[None, start:] > row_positions
        if window is not None:
            hidden_columns |= columns[None, :] <= row_positions - window
        logits[:, :, start:].masked_fill_(hidden_columns, float("-inf"))
        probabilities = logits.softmax(dim=-1)
        attention[:, first:end] = torch.matmul(probabilities, values).reshape(heads, end - first, dim)
        mass += probabilities.reshape(-1, length).sum(dim=0)
    last_row = probabilities.reshape(heads, end - first, length)[:, -1].sum(dim=0)
    return attention, mass, last_row
