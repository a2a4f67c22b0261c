"""Passages pasted into a prompt: the span finder, fusion with fresh chunks, and reuse
through a real LMDB store, on the packaged SmolLM2 (float32 reference numerics)."""

from __future__ import annotations

import random

import pytest
import torch

from ragkv.app.chat.conversation import render_conversation
from ragkv.app.passages import PromptPassages, SpanConfig, SpanFinder
from ragkv.fusion import STRATEGY_NAMES, FusionInput, LoadedChunk, build_strategy
from ragkv.fusion.fidelity import next_token_kl
from ragkv.store.url import open_store

PASSAGES = [
    "Gull Point Light was first lit on 3 March 1851 and burned whale oil until 1890, when the keepers "
    "moved to kerosene; the tower stands on a granite ledge north of the harbour entrance. " * 2,
    "Linden Hill Orchard grows nineteen apple varieties on twelve hectares of slope above the river, "
    "and its cider house opened to visitors in 1984 after the old barn was rebuilt. " * 2,
    "Hallerberg Observatory sits at 1,240 metres on the ridge above the valley towns; its main "
    "telescope, a 60 cm reflector, was installed in 1962 and automated in 2004. " * 2,
    "The Marrow Creek ferry carried carts and cattle across the estuary from 1822 until the "
    "iron bridge opened in 1907, and its landing stage is now a small museum. " * 2,
]
QUESTION = "When was Gull Point Light first lit?"


def prompt_ids(engine, order, header=lambda i: "") -> list[int]:
    documents = "\n\n".join(header(i) + PASSAGES[j] for i, j in enumerate(order))
    messages = [
        {"role": "system", "content": "Answer the question using the documents given."},
        {"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: {QUESTION}"},
    ]
    return render_conversation(engine.prompt, messages).token_ids


def span_tokens(finder: SpanFinder, ids: list[int]) -> list[tuple[int, ...]]:
    return [tuple(ids[s.start : s.end]) for s in finder.spans(ids)]


@pytest.fixture(scope="module")
def finder(engine) -> SpanFinder:
    return SpanFinder(engine.tokenizer, SpanConfig(min_tokens=24))


def test_a_passage_is_the_same_span_in_any_order_and_under_any_header(engine, finder):
    original = span_tokens(finder, prompt_ids(engine, [0, 1, 2, 3]))
    assert len(original) == len(PASSAGES)
    assert set(original) == {tuple(engine.tokenize(p.strip())) for p in PASSAGES}  # each passage's own tokens
    shuffled = span_tokens(finder, prompt_ids(engine, [3, 1, 0, 2], header=lambda i: f"Document [{i + 1}]:\n"))
    assert set(shuffled) == set(original)
    tagged = span_tokens(finder, prompt_ids(engine, [2, 0], header=lambda i: f"[CONTEXT {i}]:\n"))
    assert set(tagged) <= set(original) and len(tagged) == 2


def test_the_last_block_and_short_blocks_are_never_spans(engine, finder):
    ids = prompt_ids(engine, [0, 1])
    spans = finder.spans(ids)
    assert len(spans) == 2
    assert engine.tokenizer.decode(ids[spans[-1].end :]).lstrip().startswith(f"Question: {QUESTION}")
    short = engine.prompt.encode_messages([{"role": "user", "content": "Hello\n\nthere\n\nfriend"}])
    assert finder.spans(short) == []


def test_a_long_passage_is_cut_the_same_way_wherever_it_stands(engine):
    config = SpanConfig(min_tokens=24, max_tokens=64, cut_bits=4, window=8)
    finder = SpanFinder(engine.tokenizer, config)
    long_passage = " ".join(PASSAGES)  # one block of several hundred tokens
    pieces = []
    for before in ("Intro line.\n\n", "A different opening paragraph that is longer than the first.\n\n"):
        ids = engine.prompt.encode(before + long_passage + "\n\nQuestion: why?")
        found = finder.spans(ids)
        assert len(found) > 2 and all(config.min_tokens <= len(s) <= config.max_tokens for s in found)
        pieces.append([tuple(ids[s.start : s.end]) for s in found])
    assert pieces[0] == pieces[1]


def _fresh_input(engine, order, fresh: set[int]) -> tuple[FusionInput, list[int]]:
    """The prompt of `order` as [prefix | passages and the blank lines between | question],
    passages in `fresh` without K/V, the others with their K/V computed alone."""
    ids = prompt_ids(engine, order)
    spans = SpanFinder(engine.tokenizer, SpanConfig(min_tokens=24)).spans(ids)
    chunks, position = [], spans[0].start
    for index, span in enumerate(spans):
        if span.start > position:
            chunks.append(LoadedChunk(ids[position : span.start]))
        span_ids = ids[span.start : span.end]
        if index in fresh:
            chunks.append(LoadedChunk(span_ids))
        else:
            keys, values = engine.model.chunk_kv(torch.tensor(span_ids), engine.chunk_prefix_cache())
            chunks.append(LoadedChunk(span_ids, keys, values))
        position = span.end
    fusion_input = FusionInput(ids[: spans[0].start], chunks, ids[spans[-1].end :], len(engine.chunk_prefix_ids))
    return fusion_input, ids


def _prefix_cache(engine, ids: list[int]):
    cache = engine.model.new_cache(len(ids))
    engine.model.prefill(torch.tensor(ids), cache)
    return cache


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_every_chunk_fresh_is_the_full_prefill(engine, name):
    fusion_input, ids = _fresh_input(engine, [0, 1, 2, 3], fresh={0, 1, 2, 3})
    _, reference = engine.prefill(ids)
    fusion = build_strategy(name).fuse(engine.model, fusion_input, _prefix_cache(engine, fusion_input.prefix_ids))
    torch.testing.assert_close(fusion.logits, reference, atol=1e-4, rtol=1e-4)
    assert fusion.reused_tokens == 0


def test_fresh_kv_is_the_pre_rope_kv_in_the_prompts_context(engine):
    fusion_input, ids = _fresh_input(engine, [0, 1, 2], fresh={1})
    fusion = build_strategy("probe").fuse(engine.model, fusion_input, _prefix_cache(engine, fusion_input.prefix_ids))
    chunk = next(i for i, c in enumerate(fusion_input.chunks) if c.fresh and len(c.token_ids) > 24)
    start, end = fusion.layout.chunk_spans[chunk]
    keys, values = fusion.fresh_chunk_kv(chunk)
    # the same rows computed by a plain prefill of everything before them, then the span
    before = _prefix_cache(engine, ids[:start])
    expected_keys, expected_values = engine.model.chunk_kv(torch.tensor(ids[start:end]), before)
    # rows before the span include reused (not recomputed) rows in the fusion: close, not equal
    assert keys.shape == expected_keys.shape
    assert float((keys - expected_keys).abs().mean()) < 0.05 * float(expected_keys.abs().mean())
    assert float((values - expected_values).abs().mean()) < 0.05 * float(expected_values.abs().mean())


def test_mixed_fresh_and_stored_chunks_stay_near_the_full_prefill(engine):
    fusion_input, ids = _fresh_input(engine, [2, 0, 3, 1], fresh={1, 3})
    _, reference = engine.prefill(ids)
    strategy = build_strategy("probe:min_rows=0,escalate_kl=0")  # its budget exactly
    fusion = strategy.fuse(engine.model, fusion_input, _prefix_cache(engine, fusion_input.prefix_ids))
    fresh_rows = set(fusion.layout.fresh_rows.tolist())
    assert fresh_rows <= set(fusion.final_rows.tolist())  # computed at every layer
    stored = fusion.layout.num_reused_document_tokens
    assert 0 < stored < fusion.layout.num_document_tokens
    assert fusion.recomputed_tokens == round(strategy.ratio * stored)
    stored_input = _fresh_input(engine, [2, 0, 3, 1], fresh=set())[0]
    reuse_all = build_strategy("pie").fuse(engine.model, stored_input, _prefix_cache(engine, stored_input.prefix_ids))
    assert next_token_kl(reference, fusion.logits) < next_token_kl(reference, reuse_all.logits)


@pytest.fixture
def passages(engine, tmp_path):
    store = open_store(f"lmdb://{tmp_path / 'store'}")
    yield PromptPassages(engine, store, SpanConfig(min_tokens=24))
    store.close()


def _fuse(engine, passages: PromptPassages, tenant: str, ids: list[int]):
    return passages.prepare_prompt(tenant, ids, build_strategy("probe"), 8)


def test_passages_seen_once_are_reused_from_the_store_in_another_order(engine, passages):
    cold_ids = prompt_ids(engine, [0, 1, 2, 3])
    _, cold_reference = engine.prefill(cold_ids)
    cold = _fuse(engine, passages, "alice", cold_ids)
    assert (cold.plan.hits, cold.plan.misses) == (0, 4)
    assert cold.usage.cached_tokens == 0
    torch.testing.assert_close(cold.fusion.logits, cold_reference, atol=1e-4, rtol=1e-4)  # all new: exact

    order = [3, 1, 0, 2]
    random.Random(0).shuffle(order)
    warm_ids = prompt_ids(engine, order, header=lambda i: f"Document [{i + 1}]:\n")
    _, warm_reference = engine.prefill(warm_ids)
    warm = _fuse(engine, passages, "alice", warm_ids)
    assert (warm.plan.hits, warm.plan.misses) == (4, 0)
    passage_tokens = sum(len(s) for s in cold.plan.spans)
    assert passage_tokens >= sum(len(engine.tokenize(p.strip())) for p in PASSAGES)
    assert warm.plan.reused_tokens == passage_tokens
    # cached = the passages' rows less the probe's recomputed share
    assert warm.usage.cached_tokens == passage_tokens - warm.fusion.recomputed_tokens
    assert next_token_kl(warm_reference, warm.fusion.logits) < 0.1
    counters = passages.counters.snapshot()
    assert (counters.hits, counters.misses, counters.tokens_reused) == (4, 4, passage_tokens)

    other_tenant = _fuse(engine, passages, "bob", warm_ids)  # the tenant's salt: nothing shared
    assert other_tenant.plan.hits == 0
