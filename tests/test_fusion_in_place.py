"""Fusing into a cached prefix in place (a chat follow-up's conversation) gives the same
cache and logits as copying the prefix into a new cache, and leaves the prefix rows as
they were."""

from __future__ import annotations

import pytest
import torch
from fusion_cases import fused_case

from ragkv.fusion import FusionInput, build_strategy


@pytest.fixture(scope="module")
def conversation(engine):
    fusion_input, _ = fused_case(engine)
    # a longer, conversation-like prefix: the RAG prefix and a few turns of text after it
    history = engine.tokenize("User: tell me about lighthouses. Assistant: they guide ships at night. " * 4)
    prefix_ids = fusion_input.prefix_ids + history
    prefix = engine.model.new_cache(len(prefix_ids))
    engine.model.prefill(torch.tensor(prefix_ids), prefix)
    return FusionInput(
        prefix_ids,
        fusion_input.chunks,
        fusion_input.question_ids,
        fusion_input.chunk_precompute_offset,
        fusion_input.question_text_span,
    ), prefix


@pytest.mark.parametrize("spec", ["probe", "a3:ratio=0.2", "epic"])
def test_in_place_fusion_equals_the_copy(engine, conversation, spec):
    conversation, base = conversation
    prefix_ids = conversation.prefix_ids
    prefix = base.clone(extra_capacity=8)
    before = prefix.keys[:, :, : len(prefix_ids)].clone(), prefix.values[:, :, : len(prefix_ids)].clone()

    strategy = build_strategy(spec)
    copied = strategy.fuse(engine.model, conversation, prefix, 8)
    assert copied.cache is not prefix
    in_place = strategy.fuse(engine.model, conversation, prefix, 8, in_place=True)
    assert in_place.cache is prefix and prefix.length == copied.cache.length
    torch.testing.assert_close(in_place.logits, copied.logits, atol=1e-5, rtol=1e-5)
    rows = copied.layout.length
    torch.testing.assert_close(prefix.keys[:, :, :rows], copied.cache.keys[:, :, :rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prefix.values[:, :, :rows], copied.cache.values[:, :, :rows], atol=1e-5, rtol=1e-5)
    assert torch.equal(prefix.keys[:, :, : len(prefix_ids)], before[0])
    assert torch.equal(prefix.values[:, :, : len(prefix_ids)], before[1])
    assert torch.equal(in_place.final_rows, copied.final_rows)
