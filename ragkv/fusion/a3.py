"""`a3`: attention-aware selective recompute (the A3 paper), with the variants measured
for ragkv's default.

Layers below the check layer run for every token. At the check layer the true K of every
token is formed and each document token d is scored by the attention the question pays
it, s(d) = sum over question rows j of softmax(q_j K^T / sqrt(D))[d]; the top r·n document
tokens are recomputed from then on. The fields below are the variants measured;
`deviation_share=0` with the other defaults is the paper's rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.fusion.base import SelectionContext, top_k_rows
from ragkv.fusion.cacheblend import kv_deviation
from ragkv.fusion.epic import boundary_rows
from ragkv.fusion.layout import Layout
from ragkv.fusion.ratio import RatioStrategy

QUERY_TOKENS = ("segment", "text")
HEAD_AGGREGATIONS = ("sum", "max", "normalized")


@dataclass
class A3(RatioStrategy):
    name = "a3"
    query_tokens: str = "segment"
    """Question rows that score document tokens: 'segment' (all) or 'text' (its words)."""
    head_aggregation: str = "sum"
    """How heads combine: sum, max, or normalized (each head an equal vote)."""
    exclude_sinks: bool = False
    """Leave the prefix (attention-sink) columns out of the softmax."""
    boundary_tokens: int = 0
    """Part of the budget always spent on the first/last N tokens of each chunk."""
    deviation_share: float = 0.5
    """Share of the budget chosen by KV deviation (0 = the A3 paper; 0.5 measured best,
    see BENCHMARKS.md)."""
    attention_coverage: float = 0.0
    """Per-query budget: stop adding attention-ranked tokens once they hold this share of
    the question's attention to the documents (the deviation part shrinks with them);
    `ratio` stays the cap. 0 = always spend the whole ratio."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.query_tokens not in QUERY_TOKENS:
            raise ValueError(f"query_tokens must be one of {QUERY_TOKENS}")
        if self.head_aggregation not in HEAD_AGGREGATIONS:
            raise ValueError(f"head_aggregation must be one of {HEAD_AGGREGATIONS}")
        if self.boundary_tokens < 0:
            raise ValueError("boundary_tokens must be >= 0")
        if not 0.0 <= self.deviation_share <= 1.0:
            raise ValueError("deviation_share must be in [0, 1]")
        if not 0.0 <= self.attention_coverage <= 1.0:
            raise ValueError("attention_coverage must be in [0, 1]")
        if self.attention_coverage and self.deviation_share == 1.0:
            raise ValueError("attention_coverage needs an attention share: deviation_share must be below 1")

    def select(self, context: SelectionContext) -> torch.Tensor:
        layout, rows = context.layout, context.rows
        budget = self.budget(layout)
        chosen = torch.zeros(rows.numel(), dtype=torch.bool, device=rows.device)
        if self.boundary_tokens:
            chosen[torch.isin(rows, boundary_rows(layout, self.boundary_tokens).to(rows.device))] = True
        attention_budget = budget - int(chosen.sum())
        deviation_budget = int(round(self.deviation_share * attention_budget))
        attention_budget -= deviation_budget
        is_document = (rows >= layout.prefix_len) & (rows < layout.question_start)
        attention = self.question_attention(context)
        mass = attention.masked_fill(~is_document, 0.0)
        if self.attention_coverage and attention_budget > 0:
            needed = tokens_covering(mass, self.attention_coverage)
            if needed < attention_budget:
                deviation_budget = int(round(deviation_budget * needed / attention_budget))
                attention_budget = needed
        for scores, share in ((attention, attention_budget), (kv_deviation(context, "v"), deviation_budget)):
            if share > 0:
                scores = scores.masked_fill(chosen | ~is_document, float("-inf"))
                available = int(torch.isfinite(scores).sum())
                chosen[top_k_rows(scores, min(share, available))] = True
        context.report["attention_covered"] = float(mass[chosen].sum() / mass.sum().clamp_min(1e-12))
        context.report["recomputed_share"] = int((chosen & is_document).sum()) / max(1, layout.num_document_tokens)
        return chosen.nonzero().flatten()

    def question_attention(self, context: SelectionContext) -> torch.Tensor:
        """s(d) for every row in `context.rows` (-inf for non-document rows)."""
        layout, rows, projection = context.layout, context.rows, context.projection
        first, end = self._scoring_rows(layout)
        question_index = ((rows >= first) & (rows < end)).nonzero().flatten()
        # Scored in float32 whatever the model dtype: the ranking, not the speed, matters here.
        q = projection.q[:, question_index].float()  # [Hq, Nq, D]
        keys = context.cache.keys[context.layer, :, : layout.length].to(torch.float32, copy=True)
        keys[:, rows] = projection.k.float()
        first_column = layout.prefix_len if self.exclude_sinks else 0
        keys = keys[:, first_column:]
        group = context.model.spec.group_size
        logits = torch.einsum("hqd,hkd->hqk", q, keys.repeat_interleave(group, dim=0)) * context.model.scale
        columns = torch.arange(first_column, layout.length, device=rows.device)
        causal = columns[None, :] <= rows[question_index][:, None]
        weights = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1).sum(dim=1)  # [Hq, columns]
        document = weights[:, layout.prefix_len - first_column : layout.question_start - first_column]
        if self.head_aggregation == "normalized":
            document = document / document.sum(dim=1, keepdim=True).clamp_min(1e-12)
        per_token = document.max(dim=0).values if self.head_aggregation == "max" else document.sum(dim=0)
        scores = torch.full((rows.numel(),), float("-inf"), device=rows.device)
        is_document = (rows >= layout.prefix_len) & (rows < layout.question_start)
        scores[is_document] = per_token[rows[is_document] - layout.prefix_len]
        return scores

    def _scoring_rows(self, layout: Layout) -> tuple[int, int]:
        if self.query_tokens == "text" and layout.question_text_span is not None:
            start, end = layout.question_text_span
            return layout.question_start + start, layout.question_start + end
        return layout.question_start, layout.length


def tokens_covering(mass: torch.Tensor, share: float) -> int:
    """How many of the heaviest entries of `mass` (>= 0) it takes to hold `share` of its sum."""
    ordered = mass.sort(descending=True).values.cumsum(0)
    return int(torch.searchsorted(ordered, share * ordered[-1]).clamp_max(mass.numel() - 1)) + 1
