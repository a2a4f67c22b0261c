"""Correctness anchors of the fusion strategies on the packaged SmolLM2, with chunk KV
kept in float32 so the comparisons are exact up to float rounding."""

from __future__ import annotations

import pytest
import torch

from ragkv.bench.metrics import kl_divergence
from ragkv.fusion import A3, CacheBlend, Epic, Full, FullReuse, FusionConfig, FusionInput, LoadedChunk, Pie

TEXTS = [
    "Gull Point Light was first lit on 3 March 1851 and burned whale oil until 1890. " * 3,
    "Linden Hill Orchard grows nineteen apple varieties on twelve hectares of slope. " * 3,
    "Hallerberg Observatory sits at 1,240 metres on the ridge above the valley towns. " * 3,
]
QUESTION = "When was Gull Point Light first lit?"


@pytest.fixture(scope="module")
def fused_case(engine):
    chunks = []
    for text in TEXTS:
        ids = engine.tokenize(text)
        keys, values = engine.model.chunk_kv(torch.tensor(ids), engine.chunk_prefix_cache())
        chunks.append(LoadedChunk(ids, keys, values))
    segments = engine.prompt.rag_segments(QUESTION)
    fusion_input = FusionInput(segments.prefix_ids, chunks, segments.question_ids,
                               len(engine.chunk_prefix_ids), segments.question_text_span)
    prompt = segments.prefix_ids + sum((c.token_ids for c in chunks), []) + segments.question_ids
    _, reference_logits = engine.prefill(prompt)
    return fusion_input, reference_logits


def _fuse(engine, strategy, fusion_input):
    return strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache())


def test_full_equals_plain_prefill(engine, fused_case):
    fusion_input, reference = fused_case
    torch.testing.assert_close(_fuse(engine, Full(), fusion_input).logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", [A3(ratio=1.0), CacheBlend(ratio=1.0), A3(ratio=1.0, check_layer=4, head_aggregation="max")])
def test_ratio_one_reproduces_full_prefill(engine, fused_case, strategy):
    fusion_input, reference = fused_case
    result = _fuse(engine, strategy, fusion_input)
    torch.testing.assert_close(result.logits, reference, atol=1e-4, rtol=1e-4)
    assert result.reused_tokens == 0


def test_single_chunk_with_pie_reproduces_full(engine, fused_case):
    fusion_input, _ = fused_case
    single = FusionInput(fusion_input.prefix_ids, fusion_input.chunks[:1], fusion_input.question_ids,
                         fusion_input.chunk_precompute_offset)
    _, reference = engine.prefill(single.prefix_ids + single.chunks[0].token_ids + single.question_ids)
    torch.testing.assert_close(_fuse(engine, Pie(), single).logits, reference, atol=1e-4, rtol=1e-4)


def test_position_recovery_places_exact_keys(engine, fused_case):
    """Reused keys in the fused cache equal keys computed at those global positions."""
    fusion_input, _ = fused_case
    result = _fuse(engine, Pie(), fusion_input)
    start, end = result.layout.chunk_spans[2]
    chunk = fusion_input.chunks[2]
    for layer in (0, 15, 29):
        direct = engine.model.rotary.rotate(chunk.keys[layer], torch.arange(start, end))
        torch.testing.assert_close(result.cache.keys[layer, :, start:end], direct, atol=1e-5, rtol=1e-5)


def test_full_reuse_keeps_local_positions(engine, fused_case):
    fusion_input, _ = fused_case
    result = _fuse(engine, FullReuse(), fusion_input)
    start, end = result.layout.chunk_spans[1]
    offset = fusion_input.chunk_precompute_offset
    local = engine.model.rotary.rotate(fusion_input.chunks[1].keys[3], offset + torch.arange(end - start))
    torch.testing.assert_close(result.cache.keys[3, :, start:end], local, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", [
    CacheBlend(ratio=0.2), A3(ratio=0.2), A3(ratio=0.2, exclude_sinks=True, head_aggregation="normalized"),
    A3(ratio=0.2, deviation_share=0.5, boundary_tokens=2, query_tokens="text"),
])
def test_selective_strategies_spend_exactly_their_budget(engine, fused_case, strategy):
    fusion_input, _ = fused_case
    result = _fuse(engine, strategy, fusion_input)
    documents = result.layout.num_document_tokens
    assert result.recomputed_tokens == round(0.2 * documents)
    assert result.recomputed_tokens + result.reused_tokens == documents


def test_partial_recompute_moves_towards_full(engine, fused_case):
    """More recompute brings the first-token distribution closer to the full prefill."""
    fusion_input, reference = fused_case
    kls = [kl_divergence(reference, _fuse(engine, A3(ratio=r), fusion_input).logits) for r in (0.0, 0.5, 1.0)]
    assert kls[2] < 1e-6
    assert kls[0] > kls[1] > kls[2]


def test_epic_recomputes_chunk_boundaries(engine, fused_case):
    fusion_input, _ = fused_case
    result = _fuse(engine, Epic(boundary_tokens=4), fusion_input)
    assert result.recomputed_tokens == 8 * len(fusion_input.chunks)


def test_fusion_config_validates():
    with pytest.raises(ValueError, match="unknown fusion strategy"):
        FusionConfig(strategy="magic")
    with pytest.raises(ValueError, match="ratio"):
        FusionConfig(ratio=1.5)
    with pytest.raises(ValueError):
        FusionConfig(a3_head_aggregation="median")
