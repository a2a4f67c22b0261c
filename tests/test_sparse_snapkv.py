"""SnapKV eviction against transformers' own attention probabilities, and its composition
with fusion and with the selectors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_model
from transformers import LlamaForCausalLM

from ragkv.engine.model import CausalLM
from ragkv.fusion import FusionConfig, FusionInput, LoadedChunk
from ragkv.sparse import PromptState, SnapKV, SparseConfig

ROWS, PREFIX, QUESTION = 200, 6, 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama-snap"))


@pytest.fixture(scope="module")
def model(folder):
    return CausalLM.load(folder)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 500, (ROWS,), generator=torch.Generator().manual_seed(11))


def prefilled(model, ids, extra=16):
    cache = model.new_cache(ids.numel() + extra)
    logits = model.prefill(ids, cache)
    return cache, logits


def greedy(model, cache, logits, attention, steps):
    out, token = [], int(logits.argmax())
    for _ in range(steps):
        logits = model.decode_step(token, cache, attention)
        out.append(logits)
        token = int(logits.argmax())
    return torch.stack(out)


def test_kept_rows_match_a_reference_from_transformers_attention(folder, model, ids):
    reference = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        attentions = reference(ids.unsqueeze(0), output_attentions=True).attentions  # per layer [1, Hq, T, T]
    capacity, kernel = 80, 7
    cache, _ = prefilled(model, ids)
    original = cache.clone()
    prompt = PromptState.from_prefill(model, cache, ids, PREFIX, ROWS - QUESTION)
    kept = SnapKV(capacity, kernel).evict(prompt)
    spec = model.spec
    assert kept.shape == (spec.num_layers, spec.num_kv_heads, capacity)
    assert cache.length == capacity and cache.next_position == ROWS
    budget = capacity - PREFIX - QUESTION
    for layer in range(spec.num_layers):
        window = attentions[layer][0, :, ROWS - QUESTION :, :]  # [Hq, Nq, T]
        scores = window.sum(1).view(spec.num_kv_heads, spec.group_size, ROWS).sum(1)[:, PREFIX : ROWS - QUESTION]
        pooled = F.max_pool1d(scores.unsqueeze(1), kernel, 1, kernel // 2).squeeze(1)
        for head in range(spec.num_kv_heads):
            rows = kept[layer, head].tolist()
            assert rows[:PREFIX] == list(range(PREFIX))
            assert rows[-QUESTION:] == list(range(ROWS - QUESTION, ROWS))
            assert rows == sorted(rows)
            chosen = set(rows[PREFIX:-QUESTION])
            expected = set((pooled[head].topk(budget).indices + PREFIX).tolist())
            # ties in the pooled scores (a max-pool repeats values) may break differently
            assert len(chosen & expected) >= budget - 2
            assert (
                pooled[head][torch.tensor(sorted(chosen)) - PREFIX].min()
                >= pooled[head].topk(budget).values.min() - 1e-5
            )
            # the compacted cache holds exactly those rows, in order
            torch.testing.assert_close(cache.keys[layer, head, :capacity], original.keys[layer, head, rows])
            torch.testing.assert_close(cache.values[layer, head, :capacity], original.values[layer, head, rows])


def test_capacity_covering_the_prompt_decodes_exactly_like_dense(model, ids):
    cache, logits = prefilled(model, ids)
    reference = greedy(model, cache.clone(16), logits, None, 5)
    work = cache.clone(16)
    attention = SparseConfig(selector="dense", snapkv_capacity=ROWS).build(
        PromptState.from_prefill(model, work, ids, PREFIX, ROWS - QUESTION)
    )
    assert work.length == ROWS
    torch.testing.assert_close(greedy(model, work, logits, attention, 5), reference, rtol=1e-5, atol=1e-5)


def test_selectors_work_on_the_compacted_cache(model, ids):
    """After eviction a selector with a budget covering everything equals dense decode of
    the compacted cache (engine path, no attention object) with the same eviction."""
    cache, logits = prefilled(model, ids)
    evicted = cache.clone(16)
    SnapKV(90).evict(PromptState.from_prefill(model, evicted, ids, PREFIX, ROWS - QUESTION))
    reference = greedy(model, evicted, logits, None, 5)
    for selector in ("oracle", "pqcache", "lrqk"):
        work = cache.clone(16)
        config = SparseConfig(selector=selector, budget=1.0, window=4, snapkv_capacity=90)
        attention = config.build(PromptState.from_prefill(model, work, ids, PREFIX, ROWS - QUESTION))
        torch.testing.assert_close(greedy(model, work, logits, attention, 5), reference, rtol=1e-4, atol=1e-4)
        assert attention.positions.table is not None and attention.ready == [90] * model.spec.num_layers


def test_positions_after_eviction_continue_from_next_position(model, ids):
    cache, logits = prefilled(model, ids, extra=32)
    config = SparseConfig(selector="lrqk", budget=0.5, window=4, sinks=2, snapkv_capacity=60)
    attention = config.build(PromptState.from_prefill(model, cache, ids, PREFIX, ROWS - QUESTION))
    greedy(model, cache, logits, attention, 20)
    positions = attention.positions.of(0, 0, cache.length, model.spec.num_kv_heads)
    assert positions[:, 60:].tolist() == [list(range(ROWS, ROWS + 20))] * model.spec.num_kv_heads
    assert positions[:, :PREFIX].tolist() == [list(range(PREFIX))] * model.spec.num_kv_heads
    assert cache.next_position == ROWS + 20


def test_capacity_below_prefix_and_question_is_refused(model, ids):
    cache, _ = prefilled(model, ids)
    with pytest.raises(ValueError):
        SnapKV(PREFIX + QUESTION - 1).evict(PromptState.from_prefill(model, cache, ids, PREFIX, ROWS - QUESTION))


@pytest.mark.parametrize("strategy", ("pie", "a3"))
def test_eviction_composes_with_fusion(model, strategy):
    """On a fused cache (check-layer strategy included) eviction keeps prefix and question
    rows, compacts in place and decoding continues at the right position."""
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 500, (PREFIX,), generator=generator)
    chunks = []
    for _ in range(3):
        tokens = torch.randint(3, 500, (48,), generator=generator)
        keys, values = model.chunk_kv(tokens)
        chunks.append(LoadedChunk(tokens.tolist(), keys, values))
    question = torch.randint(3, 500, (QUESTION,), generator=generator).tolist()
    prefix_cache = model.new_cache(PREFIX)
    model.prefill(prefix, prefix_cache)
    fusion_input = FusionInput(prefix.tolist(), chunks, question)
    result = FusionConfig(strategy=strategy, ratio=0.2).build().fuse(model, fusion_input, prefix_cache, 8)
    prompt = PromptState.from_fusion(model, result)
    queries = prompt.question_queries()
    assert len(queries) == model.spec.num_layers and queries[0].shape[1] == QUESTION
    original = result.cache.clone()
    length = result.layout.length
    kept = SnapKV(60).evict(prompt)
    for layer in range(model.spec.num_layers):
        for head in range(model.spec.num_kv_heads):
            rows = kept[layer, head].tolist()
            assert rows[:PREFIX] == list(range(PREFIX)) and rows[-QUESTION:] == list(range(length - QUESTION, length))
            torch.testing.assert_close(result.cache.keys[layer, head, :60], original.keys[layer, head, rows])
    # decoding continues at the right position
    token = int(result.logits.argmax())
    model.decode_step(token, result.cache, None)
    assert result.cache.length == 61 and result.cache.next_position == length + 1
