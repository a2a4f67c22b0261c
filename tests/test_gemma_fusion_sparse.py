"""Fusion strategies and sparse selectors on a tiny random Gemma 3 (sliding-window layers
with their own RoPE base, window 8 so it cuts across the 40-token chunks), against the
plain prefill and dense decode of the same model."""

from __future__ import annotations

import pytest
import torch
from fusion_cases import fusion_case
from tiny_models import make_tiny_model

from ragkv.engine.model import CausalLM
from ragkv.fusion import STRATEGY_NAMES, FusionInput, LoadedChunk, Pie, build_strategy
from ragkv.kernels import reference
from ragkv.kernels.kv_quant import quantize
from ragkv.kernels.place_kv import layers_of
from ragkv.sparse import PromptState, SparseConfig, selector_names
from ragkv.sparse.calibrate import CalibrationConfig, calibrate


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model = CausalLM.load(make_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3")))
    assert model.spec.sliding_layers == (0, 2, 3) and model.spec.sliding_window == 8
    return model


@pytest.fixture(scope="module")
def case(model):
    return fusion_case(model, vocab=128)


def test_full_fusion_reproduces_the_full_prefill(model, case):
    fusion_input, prefix_cache, expected = case
    result = build_strategy("full").fuse(model, fusion_input, prefix_cache)
    torch.testing.assert_close(result.logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", ["a3:ratio=1", "cacheblend:ratio=1", "probe:ratio=1"])
def test_recomputing_every_row_reproduces_the_full_prefill(model, case, spec):
    fusion_input, prefix_cache, expected = case
    result = build_strategy(spec).fuse(model, fusion_input, prefix_cache)
    torch.testing.assert_close(result.logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_every_strategy_fuses_and_decodes(model, case, name):
    fusion_input, prefix_cache, expected = case
    result = build_strategy(name).fuse(model, fusion_input, prefix_cache, extra_capacity=4)
    assert result.logits.shape == expected.shape and torch.isfinite(result.logits).all()
    assert torch.isfinite(model.decode_step(int(result.logits.argmax()), result.cache)).all()


def test_position_recovery_rotates_each_layer_with_its_own_base(model, case):
    fusion_input, prefix_cache, _ = case
    result = Pie().fuse(model, fusion_input, prefix_cache)
    start, end = result.layout.chunk_spans[2]
    stored = fusion_input.chunks[2].keys
    positions = torch.arange(start, end)
    for layer in range(model.spec.num_layers):
        expected = model.rotary_of(layer).rotate(stored[layer], positions)
        torch.testing.assert_close(result.cache.keys[layer, :, start:end], expected, atol=1e-5, rtol=1e-5)
    # the two bases differ at these positions, so the test would catch one base for all layers
    local, global_ = model.rotary_of(0), model.rotary
    assert not torch.allclose(global_.rotate(stored[0], positions), local.rotate(stored[0], positions))


def test_quantized_chunks_are_placed_per_run_of_layers(model, case):
    fusion_input, prefix_cache, _ = case
    quantized = [
        LoadedChunk(c.token_ids, quantize(c.keys, 4, "tokens", 32), quantize(c.values, 4, "channels", 16))
        for c in fusion_input.chunks
    ]
    coded = FusionInput(
        fusion_input.prefix_ids, quantized, fusion_input.question_ids, fusion_input.chunk_precompute_offset
    )
    result = Pie().fuse(model, coded, prefix_cache)
    start, end = result.layout.chunk_spans[1]
    for layer in range(model.spec.num_layers):
        cos, sin = model.rotary_of(layer).cos_sin(torch.arange(start, end))
        one = layers_of(quantized[1].keys, slice(layer, layer + 1))
        expected = reference.place_keys(one, cos, sin, model.dtype)[0]
        torch.testing.assert_close(result.cache.keys[layer, :, start:end], expected, atol=1e-5, rtol=1e-5)


def test_a_reused_chunk_differs_after_a_local_layer_only_where_its_window_reaches_back(model, case):
    """A layer's K/V are projections of the hidden state the layers below produced. Layer
    0 is local (window 8), so at layer 1 a chunk token's K/V equal the full prefill's once
    its window lies inside the chunk (offset >= 7); tokens whose window reaches into what
    preceded the chunk differ. Layer 1 is global, so from layer 2 on every token differs."""
    fusion_input, prefix_cache, _ = case
    reused = build_strategy("full_reuse").fuse(model, fusion_input, prefix_cache).cache
    result = build_strategy("full").fuse(model, fusion_input, prefix_cache)
    full, (start, end) = result.cache, result.layout.chunk_spans[1]
    window = model.spec.sliding_window

    def deviation(layer):  # values: full_reuse keeps keys at their precompute positions
        return (reused.values[layer, :, start:end] - full.values[layer, :, start:end]).abs().amax(dim=(0, 2))

    assert deviation(0).max() < 1e-5  # embeddings only
    assert deviation(1)[window - 1 :].max() < 1e-5
    assert deviation(1)[: window - 1].min() > 1e-4
    assert deviation(2)[window - 1 :].min() > 1e-4


@pytest.fixture(scope="module")
def codebook(model):
    text = ["the quick brown fox jumps over the lazy dog " * 20]
    config = CalibrationConfig(codebook_size=16, tokens=256, sequence_tokens=128, iterations=3)
    return calibrate(model, lambda s: [b % 120 + 3 for b in s.encode()], text, [5, 6], config)


def _greedy(model, cache, logits, attention, steps=5):
    out, token = [], int(logits.argmax())
    for _ in range(steps):
        logits = model.decode_step(token, cache, attention)
        out.append(logits)
        token = int(logits.argmax())
    return torch.stack(out)


@pytest.mark.parametrize("selector", selector_names())
def test_every_selector_decodes_and_a_whole_budget_equals_dense(model, codebook, selector):
    ids = torch.randint(3, 128, (60,), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(70)
    logits = model.prefill(ids, cache)
    dense = _greedy(model, cache.clone(10), logits, None)
    work = cache.clone(10)
    attention = SparseConfig(selector=selector, budget=1.0, window=4).build(
        PromptState.from_prefill(model, work, ids, 3, 50), codebook
    )
    torch.testing.assert_close(_greedy(model, work, logits, attention), dense, atol=1e-4, rtol=1e-4)
    sparse = cache.clone(10)
    attention = SparseConfig(selector=selector, budget=12, sinks=2, window=4).build(
        PromptState.from_prefill(model, sparse, ids, 3, 50), codebook
    )
    assert torch.isfinite(_greedy(model, sparse, logits, attention)).all()


def test_snapkv_is_refused_with_a_reason(model):
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache(40)
    model.prefill(ids, cache)
    with pytest.raises(ValueError, match="SnapKV eviction is not available for gemma3_text"):
        SparseConfig(selector="dense", snapkv_capacity=20).build(PromptState.from_prefill(model, cache, ids, 2, 35))
