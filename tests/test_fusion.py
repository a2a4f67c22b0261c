"""Correctness anchors of the fusion strategies on the packaged SmolLM2, with chunk KV
kept in float32 so the comparisons are exact up to float rounding (the other compute
dtypes: tests/test_fusion_dtypes.py)."""

from __future__ import annotations

import pytest
import torch
from fusion_cases import fused_case

from ragkv.fusion import (
    A3,
    CacheBlend,
    Epic,
    Full,
    FullReuse,
    FusionConfig,
    FusionInput,
    LoadedChunk,
    Pie,
    Probe,
    build_strategy,
)
from ragkv.fusion.fidelity import next_token_kl


@pytest.fixture(scope="module")
def case(engine):
    return engine, *fused_case(engine)


def _fuse(engine, strategy, fusion_input):
    return strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache())


def test_full_equals_plain_prefill(case):
    engine, fusion_input, reference = case
    torch.testing.assert_close(_fuse(engine, Full(), fusion_input).logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "spec",
    [
        "a3:ratio=1",
        "cacheblend:ratio=1",
        "a3:ratio=1,check_layer=4,head_aggregation=max",
        "a3:ratio=1,deviation_share=0,exclude_sinks=true",
        "probe:ratio=1",
    ],
)
def test_ratio_one_reproduces_full_prefill(case, spec):
    engine, fusion_input, reference = case
    result = _fuse(engine, build_strategy(spec), fusion_input)
    torch.testing.assert_close(result.logits, reference, atol=1e-4, rtol=1e-4)
    assert result.reused_tokens == 0


def test_single_chunk_with_pie_reproduces_full(case):
    engine, fusion_input, _ = case
    single = FusionInput(
        fusion_input.prefix_ids,
        fusion_input.chunks[:1],
        fusion_input.question_ids,
        fusion_input.chunk_precompute_offset,
    )
    _, reference = engine.prefill(single.prefix_ids + single.chunks[0].token_ids + single.question_ids)
    torch.testing.assert_close(_fuse(engine, Pie(), single).logits, reference, atol=1e-4, rtol=1e-4)


def test_position_recovery_places_exact_keys(case):
    """Reused keys in the fused cache equal keys computed at those global positions."""
    engine, fusion_input, _ = case
    result = _fuse(engine, Pie(), fusion_input)
    start, end = result.layout.chunk_spans[2]
    chunk = fusion_input.chunks[2]
    for layer in (0, 15, 29):
        direct = engine.model.rotary.rotate(chunk.keys[layer], torch.arange(start, end))
        torch.testing.assert_close(result.cache.keys[layer, :, start:end], direct, atol=1e-5, rtol=1e-5)


def test_full_reuse_keeps_local_positions(case):
    engine, fusion_input, _ = case
    result = _fuse(engine, FullReuse(), fusion_input)
    start, end = result.layout.chunk_spans[1]
    offset = fusion_input.chunk_precompute_offset
    local = engine.model.rotary.rotate(fusion_input.chunks[1].keys[3], offset + torch.arange(end - start))
    torch.testing.assert_close(result.cache.keys[3, :, start:end], local, atol=1e-5, rtol=1e-5)


def test_full_places_no_stored_kv(case):
    """The reference recomputes every row, so stored KV (here garbage) must not matter."""
    engine, fusion_input, reference = case
    garbage = [
        LoadedChunk(c.token_ids, torch.full_like(c.keys, float("nan")), torch.full_like(c.values, float("nan")))
        for c in fusion_input.chunks
    ]
    poisoned = FusionInput(
        fusion_input.prefix_ids,
        garbage,
        fusion_input.question_ids,
        fusion_input.chunk_precompute_offset,
        fusion_input.question_text_span,
    )
    torch.testing.assert_close(_fuse(engine, Full(), poisoned).logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "strategy",
    [
        CacheBlend(ratio=0.2),
        A3(ratio=0.2),
        A3(ratio=0.2, exclude_sinks=True, head_aggregation="normalized"),
        A3(ratio=0.2, deviation_share=0.0, boundary_tokens=2, query_tokens="text"),
        Probe(ratio=0.2, min_rows=0, escalate_kl=0),
    ],
)
def test_selective_strategies_spend_exactly_their_budget(case, strategy):
    engine, fusion_input, _ = case
    result = _fuse(engine, strategy, fusion_input)
    documents = result.layout.num_document_tokens
    assert result.recomputed_tokens == round(0.2 * documents)
    assert result.recomputed_tokens + result.reused_tokens == documents


def test_partial_recompute_moves_towards_full(case):
    """More recompute brings the first-token distribution closer to the full prefill."""
    engine, fusion_input, reference = case
    kls = [next_token_kl(reference, _fuse(engine, A3(ratio=r), fusion_input).logits) for r in (0.0, 0.5, 1.0)]
    assert kls[2] < 1e-6
    assert kls[0] > kls[1] > kls[2]


def test_epic_recomputes_chunk_boundaries(case):
    engine, fusion_input, _ = case
    result = _fuse(engine, Epic(boundary_tokens=4), fusion_input)
    assert result.recomputed_tokens == 8 * len(fusion_input.chunks)


def test_fusion_config_takes_specs_and_validates():
    assert FusionConfig().build() == Probe()
    assert FusionConfig("a3:ratio=0.3,deviation_share=0").build() == A3(ratio=0.3, deviation_share=0.0)
    assert FusionConfig("cacheblend", ratio=0.4).build() == CacheBlend(ratio=0.4)
    with pytest.raises(ValueError, match="unknown fusion strategy"):
        FusionConfig(strategy="magic")
    with pytest.raises(ValueError, match="ratio"):
        FusionConfig(ratio=1.5)
    with pytest.raises(ValueError, match="head_aggregation"):
        FusionConfig("a3:head_aggregation=median")
    with pytest.raises(ValueError, match="has no option 'bogus'"):
        FusionConfig("a3:bogus=1")
    assert FusionConfig("pie", ratio=0.2).build() == Pie()
    with pytest.raises(ValueError, match="ratio"):
        FusionConfig("pie", ratio=2.0)


def test_probe_without_budget_recomputes_only_the_question_like_pie(case):
    engine, fusion_input, _ = case
    probe = _fuse(engine, Probe(ratio=0.0, min_rows=0), fusion_input)
    assert probe.recomputed_tokens == 0
    torch.testing.assert_close(probe.logits, _fuse(engine, Pie(), fusion_input).logits, atol=1e-5, rtol=1e-5)
