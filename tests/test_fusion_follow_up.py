"""Fusing a short new chunk after a long prefix (a chat follow-up): the probe recomputes the
whole chunk when it is shorter than `min_rows`, its rows reading the prefix's first rows and
its last `prefix_window` rows, the question every row. References: the full prefill, and
attention with the same visibility written as an explicit mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fusion_cases import fused_case

from ragkv.engine.model import Projection
from ragkv.fusion import FusionInput, Probe
from ragkv.fusion.base import attend
from ragkv.fusion.fidelity import next_token_kl
from ragkv.fusion.layout import Layout
from ragkv.fusion.probe import PREFIX_SINK_ROWS, probe_columns


@pytest.fixture(scope="module")
def follow_up(engine):
    """A RAG prompt's chunks after a conversation-like prefix of ~300 tokens, its cache
    prefilled exactly, and the full prefill's logits of the whole prompt."""
    fusion_input, _ = fused_case(engine)
    history = engine.tokenize("User: tell me about lighthouses. Assistant: they guide ships at night. " * 20)
    prefix_ids = fusion_input.prefix_ids + history
    prefix = engine.model.new_cache(len(prefix_ids))
    engine.model.prefill(torch.tensor(prefix_ids), prefix)
    chunks = fusion_input.chunks[:1]  # one new chunk
    fused = FusionInput(prefix_ids, chunks, fusion_input.question_ids, fusion_input.chunk_precompute_offset)
    _, reference = engine.prefill(Layout.of(fused).token_ids.tolist())
    return fused, prefix, reference


def _fuse(engine, strategy, fusion_input, prefix):
    return strategy.fuse(engine.model, fusion_input, prefix.clone(extra_capacity=8), 8, in_place=True)


def test_a_short_chunk_is_recomputed_whole_and_matches_the_full_prefill(engine, follow_up):
    fusion_input, prefix, reference = follow_up
    result = _fuse(engine, Probe(prefix_window=0), fusion_input, prefix)
    assert result.recomputed_tokens == result.layout.num_document_tokens < Probe().min_rows
    assert result.selection["recomputed_share"] == 1.0
    torch.testing.assert_close(result.logits, reference, atol=1e-4, rtol=1e-4)


def test_a_prefix_window_stays_close_to_the_full_prefill_and_below_the_chosen_rows(engine, follow_up):
    fusion_input, prefix, reference = follow_up
    windowed = _fuse(engine, Probe(prefix_window=64), fusion_input, prefix)
    chosen = _fuse(engine, Probe(min_rows=0, prefix_window=0), fusion_input, prefix)
    assert not torch.allclose(windowed.logits, reference, atol=1e-4, rtol=1e-4)  # the window is in use
    assert next_token_kl(reference, windowed.logits) < next_token_kl(reference, chosen.logits)


def test_probe_columns_keep_the_first_rows_and_at_least_the_model_window():
    layout = Layout(torch.zeros(1000, dtype=torch.long), 900, [(900, 980)], 980)
    assert probe_columns(layout, 0, None) is None
    assert probe_columns(layout, 900, None) is None  # nothing to leave out
    columns = probe_columns(layout, 100, None)
    assert torch.equal(columns, torch.cat((torch.arange(PREFIX_SINK_ROWS), torch.arange(800, 1000))))
    assert torch.equal(
        probe_columns(layout, 100, 300), torch.cat((torch.arange(PREFIX_SINK_ROWS), torch.arange(600, 1000)))
    )


@pytest.mark.parametrize("window", [None, 24])
def test_windowed_attention_of_document_rows_equals_an_explicit_mask(engine, window, monkeypatch):
    model = engine.model
    monkeypatch.setattr(type(model.spec), "layer_window", lambda self, layer: window)
    generator = torch.Generator().manual_seed(0)
    spec, length, question_start = model.spec, 200, 180
    layout = Layout(torch.zeros(length, dtype=torch.long), 150, [(150, 180)], question_start)
    cache = model.new_cache(length)
    cache.keys.normal_(generator=generator)
    cache.values.normal_(generator=generator)
    cache.length = cache.next_position = length
    rows = torch.cat((torch.tensor([151, 160, 170, 179]), torch.arange(question_start, length)))
    q = torch.randn(spec.num_heads, rows.numel(), spec.head_dim, generator=generator)
    projection = Projection(q, q[: spec.num_kv_heads], q[: spec.num_kv_heads], q[: spec.num_kv_heads])
    columns = torch.cat((torch.arange(PREFIX_SINK_ROWS), torch.arange(100, question_start)))

    out = attend(model, 0, projection, rows, cache, layout, columns)

    keys, values = cache.layer(0)
    visible = torch.arange(length)[None, :] <= rows[:, None]
    if window is not None:  # the columns' contiguous tail (100..179) is longer than the window
        visible &= torch.arange(length)[None, :] > rows[:, None] - window
    in_columns = torch.zeros(length, dtype=torch.bool)
    in_columns[columns] = True
    visible &= in_columns[None, :] | (rows >= question_start)[:, None]
    expected = F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=visible[None, None], scale=model.scale, enable_gqa=True
    )[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
