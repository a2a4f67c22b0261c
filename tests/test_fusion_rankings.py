"""a3, cacheblend and probe recompute the tokens their rules name, checked against scores
computed independently from transformers' eager forward pass of the whole prompt (a3,
cacheblend) or of the question over the reused cache (probe).

Below the check layer every row is recomputed, so at the check layer the fresh q/k/v of
every row equal the full prefill's: a3's score is then transformers' attention of the
question rows summed over heads, and cacheblend's is the distance between transformers'
value vectors and the stored ones. A ranking that picks other tokens (say, at random)
fails these tests."""

from __future__ import annotations

import pytest
import torch
from fusion_cases import fused_case
from transformers import AutoModelForCausalLM, DynamicCache

from ragkv.fusion import A3, CacheBlend, Pie, Probe

RATIO = 0.2
CHECK_LAYER = 2


@pytest.fixture(scope="module")
def transformers_model(engine):
    return AutoModelForCausalLM.from_pretrained(
        engine.model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def reference(engine, transformers_model):
    """(fusion input, layout spans, attentions [layers][Hq, T, T], values [layers][Hkv, T, D])."""
    fusion_input, _ = fused_case(engine)
    prompt = fusion_input.prefix_ids + sum((c.token_ids for c in fusion_input.chunks), []) + fusion_input.question_ids
    with torch.no_grad():
        output = transformers_model(torch.tensor([prompt]), output_attentions=True, use_cache=True)
    values = [output.past_key_values.layers[layer].values[0] for layer in range(len(output.attentions))]
    return fusion_input, [attention[0] for attention in output.attentions], values


def _chosen_document_rows(engine, strategy, fusion_input) -> tuple[set[int], int, int, int]:
    result = strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache())
    layout = result.layout
    document = [int(row) for row in result.final_rows if layout.prefix_len <= row < layout.question_start]
    return set(document), layout.prefix_len, layout.question_start, result.recomputed_tokens


def _top(scores: torch.Tensor, first_row: int, budget: int) -> set[int]:
    return {first_row + int(i) for i in scores.topk(budget).indices}


def test_a3_recomputes_the_tokens_the_question_attends_to(engine, reference):
    fusion_input, attentions, _ = reference
    chosen, start, end, budget = _chosen_document_rows(
        engine, A3(ratio=RATIO, check_layer=CHECK_LAYER, deviation_share=0.0), fusion_input
    )
    # Attention of every question row to each document token, summed over heads.
    scores = attentions[CHECK_LAYER][:, end:, start:end].sum(dim=(0, 1))
    assert budget == len(chosen) > 0
    assert chosen == _top(scores, start, budget)


def test_a3_max_head_aggregation_takes_each_tokens_best_head(engine, reference):
    fusion_input, attentions, _ = reference
    chosen, start, end, budget = _chosen_document_rows(
        engine, A3(ratio=RATIO, check_layer=CHECK_LAYER, deviation_share=0.0, head_aggregation="max"), fusion_input
    )
    scores = attentions[CHECK_LAYER][:, end:, start:end].sum(dim=1).max(dim=0).values
    assert chosen == _top(scores, start, budget)


def test_cacheblend_recomputes_the_tokens_whose_values_deviate_most(engine, reference):
    fusion_input, _, values = reference
    chosen, start, end, budget = _chosen_document_rows(
        engine, CacheBlend(ratio=RATIO, check_layer=CHECK_LAYER), fusion_input
    )
    stored = torch.cat([chunk.values[CHECK_LAYER] for chunk in fusion_input.chunks], dim=1)  # [Hkv, doc, D]
    scores = (values[CHECK_LAYER][:, start:end] - stored).pow(2).sum(dim=(0, 2))
    assert budget == len(chosen) > 0
    assert chosen == _top(scores, start, budget)


def test_a3_splits_its_budget_between_both_rankings(engine, reference):
    """deviation_share=0.5: half the budget goes to the attention ranking, the other half to
    the value-deviation ranking over the tokens not already chosen."""
    fusion_input, attentions, values = reference
    chosen, start, end, budget = _chosen_document_rows(
        engine, A3(ratio=RATIO, check_layer=CHECK_LAYER, deviation_share=0.5), fusion_input
    )
    by_attention = _top(
        attentions[CHECK_LAYER][:, end:, start:end].sum(dim=(0, 1)), start, budget - round(0.5 * budget)
    )
    stored = torch.cat([chunk.values[CHECK_LAYER] for chunk in fusion_input.chunks], dim=1)
    deviation = (values[CHECK_LAYER][:, start:end] - stored).pow(2).sum(dim=(0, 2))
    deviation[[row - start for row in by_attention]] = float("-inf")
    assert chosen == by_attention | _top(deviation, start, round(0.5 * budget))


def test_a3_attention_coverage_stops_at_the_mass_it_asks_for(engine, reference):
    """With a coverage target the budget is the fewest top tokens holding that share of the
    question's attention to the documents (the ratio only caps it), and it is reported."""
    fusion_input, attentions, _ = reference
    strategy = A3(ratio=0.9, check_layer=CHECK_LAYER, deviation_share=0.0, attention_coverage=0.5)
    result = strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache())
    start, end = result.layout.prefix_len, result.layout.question_start
    scores = attentions[CHECK_LAYER][:, end:, start:end].sum(dim=(0, 1))
    cumulative = scores.sort(descending=True).values.cumsum(0) / scores.sum()
    needed = int((cumulative < 0.5).sum()) + 1
    chosen = {int(row) for row in result.final_rows if start <= row < end}
    assert chosen == _top(scores, start, needed)
    assert needed < round(0.9 * (end - start))
    assert result.selection["attention_covered"] == pytest.approx(float(cumulative[needed - 1]), abs=1e-4)
    assert result.selection["recomputed_share"] == pytest.approx(needed / (end - start))


@pytest.mark.parametrize(("layer_aggregation", "last_row_weight"), [("sum", 0.0), ("max", 0.0), ("sum", 1.0)])
def test_probe_recomputes_the_tokens_the_question_attends_to_over_the_reused_cache(
    engine, reference, transformers_model, layer_aggregation, last_row_weight
):
    """The probe's scores: transformers runs the question over the cache as placed (pie's
    cache below the question rows: reused KV, keys at global positions); each layer's
    attention to the documents, summed over question rows and heads and normalised to 1,
    plus `last_row_weight` times the last row's share, is summed (or maxed) over layers."""
    fusion_input = reference[0]
    placed = Pie().fuse(engine.model, fusion_input, engine.chunk_prefix_cache())
    layout = placed.layout
    start, end = layout.prefix_len, layout.question_start
    past = DynamicCache()
    for layer in range(engine.model.spec.num_layers):
        past.update(
            placed.cache.keys[layer, :, :end][None].float(), placed.cache.values[layer, :, :end][None].float(), layer
        )
    with torch.no_grad():
        output = transformers_model(
            torch.tensor([fusion_input.question_ids]),
            past_key_values=past,
            position_ids=torch.arange(end, layout.length)[None],
            output_attentions=True,
        )
    question = torch.stack([attention[0, :, :, start:end].sum(dim=(0, 1)) for attention in output.attentions])
    last_row = torch.stack([attention[0, :, -1, start:end].sum(dim=0) for attention in output.attentions])
    shares = (question / question.sum(dim=1, keepdim=True)) + last_row_weight * (
        last_row / last_row.sum(dim=1, keepdim=True)
    )
    scores = shares.sum(dim=0) if layer_aggregation == "sum" else shares.max(dim=0).values
    strategy = Probe(
        ratio=RATIO, layer_aggregation=layer_aggregation, last_row_weight=last_row_weight, min_rows=0, escalate_kl=0
    )
    chosen, _, _, budget = _chosen_document_rows(engine, strategy, fusion_input)
    assert budget == len(chosen) == round(RATIO * (end - start)) > 0
    assert chosen == _top(scores, start, budget)
