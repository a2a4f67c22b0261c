"""The probe's refresh for the answer (`refresh_ratio`, ragkv.fusion.answer_refresh) against
the full prefill, on tiny random models in float32: a refresh that covers every document row
after a probe that recomputes none is the full prefill (logits, cache, teacher-forced
answer); a partial refresh recomputes only rows the probe left stale, spends its budget and
drops its draft rows; the settings are validated."""

from __future__ import annotations

import pytest
import torch
from fusion_cases import fusion_case
from tiny_models import make_tiny_model

from ragkv.engine.model import CausalLM
from ragkv.fusion import Probe, build_strategy
from ragkv.fusion import answer_refresh as refresh_module
from ragkv.fusion.fidelity import next_token_kl, teacher_forced_logits

EVERY_ROW_BY_REFRESH = "probe:ratio=0,min_rows=0,refresh_ratio=1,draft_tokens=4"


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def case(request, tmp_path_factory):
    """(model, fusion input, prefix cache, full-prefill logits); Gemma 3's sliding-window
    layers check that the drafts and the refresh read what the model's attention reads."""
    model = CausalLM.load(make_tiny_model(request.param, tmp_path_factory.mktemp(request.param)), torch.float32)
    return model, *fusion_case(model, vocab=128)


def _full_prefill(model, fusion_input):
    ids = (
        fusion_input.prefix_ids
        + sum((chunk.token_ids for chunk in fusion_input.chunks), [])
        + fusion_input.question_ids
    )
    cache = model.new_cache(len(ids) + 8)
    return cache, model.prefill(torch.tensor(ids), cache)


@pytest.mark.parametrize(
    "spec", [EVERY_ROW_BY_REFRESH, "probe:ratio=0.5,min_rows=0,refresh_ratio=1,refresh_rerun=true"]
)
def test_a_refresh_of_every_row_is_the_full_prefill(case, spec):
    model, fusion_input, prefix_cache, reference = case
    result = build_strategy(spec).fuse(model, fusion_input, prefix_cache, 8)
    assert next_token_kl(reference, result.logits) < 1e-7
    assert result.recomputed_tokens == result.layout.num_document_tokens and result.reused_tokens == 0
    assert result.cache.length == result.layout.length  # the drafts are gone
    full_cache, full_logits = _full_prefill(model, fusion_input)
    rows = result.layout.length
    torch.testing.assert_close(result.cache.keys[:, :, :rows], full_cache.keys[:, :, :rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.cache.values[:, :, :rows], full_cache.values[:, :, :rows], atol=1e-5, rtol=1e-5)
    answer = [int(full_logits.argmax()), 5, 9, 17]
    forced = teacher_forced_logits(model, result.cache, result.logits, answer)
    torch.testing.assert_close(
        forced, teacher_forced_logits(model, full_cache, full_logits, answer), atol=1e-4, rtol=1e-4
    )


@pytest.fixture
def refreshed(monkeypatch):
    """The rows each refresh pass recomputes, in call order."""
    passes = []
    recompute = refresh_module.recompute

    def spy(model, cache, layout, rows, columns):
        passes.append(rows.clone())
        return recompute(model, cache, layout, rows, columns)

    monkeypatch.setattr(refresh_module, "recompute", spy)
    return passes


def test_the_refresh_recomputes_only_stale_rows_and_spends_its_budget(case, refreshed):
    model, fusion_input, prefix_cache, _ = case
    plain = Probe(ratio=0.2, min_rows=0).fuse(model, fusion_input, prefix_cache, 8)
    result = Probe(ratio=0.2, min_rows=0, refresh_ratio=0.25).fuse(model, fusion_input, prefix_cache, 8)
    layout = result.layout
    documents = layout.num_document_tokens
    (rows,) = refreshed
    refreshed_documents = rows[rows < layout.question_start]
    assert refreshed_documents.numel() == round(0.25 * documents)
    assert torch.equal(rows[rows >= layout.question_start], layout.question_rows)
    assert not torch.isin(refreshed_documents, plain.final_rows).any()  # the probe's rows are not run twice
    assert result.recomputed_tokens == plain.recomputed_tokens + refreshed_documents.numel()
    assert result.recomputed_tokens + result.reused_tokens == documents
    assert torch.equal(result.recomputed_rows(0), torch.cat((plain.final_rows, refreshed_documents)).unique())
    assert result.selection["refreshed_share"] == pytest.approx(refreshed_documents.numel() / documents)
    assert result.cache.length == layout.length


def test_the_rerun_runs_the_probe_rows_again_with_the_refreshed_ones(case, refreshed):
    model, fusion_input, prefix_cache, _ = case
    plain = Probe(ratio=0.2, min_rows=0, refresh_ratio=0.25).fuse(model, fusion_input, prefix_cache, 8)
    rerun = Probe(ratio=0.2, min_rows=0, refresh_ratio=0.25, refresh_rerun=True).fuse(
        model, fusion_input, prefix_cache, 8
    )
    once, again = refreshed
    assert torch.equal(again, torch.cat((once, plain.recomputed_rows(0))).unique())
    assert rerun.recomputed_tokens == plain.recomputed_tokens


def test_the_refresh_stops_at_the_rows_left_stale(case):
    model, fusion_input, prefix_cache, _ = case
    result = Probe(ratio=0.7, min_rows=0, refresh_ratio=0.5).fuse(model, fusion_input, prefix_cache, 8)
    assert result.reused_tokens == 0
    assert result.selection["refreshed_share"] == pytest.approx(1 - round(0.7 * 120) / 120)


def test_nothing_left_stale_means_no_drafts_and_the_probe_result(case):
    model, fusion_input, prefix_cache, _ = case
    plain = Probe(ratio=1.0).fuse(model, fusion_input, prefix_cache, 8)
    result = Probe(ratio=1.0, refresh_ratio=0.5).fuse(model, fusion_input, prefix_cache, 8)
    assert result.selection["draft_tokens"] == result.selection["refreshed_share"] == 0.0
    assert torch.equal(result.logits, plain.logits) and torch.equal(result.final_rows, plain.final_rows)


def test_the_drafts_are_the_greedy_answer_and_leave_the_cache_as_it_was(case):
    model, fusion_input, _, _ = case
    cache, logits = _full_prefill(model, fusion_input)
    before = cache.keys.clone(), cache.values.clone(), cache.length
    drafts = refresh_module.greedy_drafts(model, cache, logits, 3)
    assert cache.length == before[2]
    expected, step = [], logits
    for _ in range(3):
        expected.append(int(step.argmax()))
        step = model.decode_step(expected[-1], cache)
    cache.truncate(before[2])
    assert drafts == expected
    layout = build_strategy("full").fuse(model, fusion_input, None).layout
    shares = refresh_module.draft_attention_by_layer(model, cache, layout, drafts)
    assert shares.shape == (model.spec.num_layers, layout.num_document_tokens)
    # a sliding-window layer whose window ends before the documents gives them nothing
    reach = [float(model.spec.layer_window(layer) is None) for layer in range(model.spec.num_layers)]
    torch.testing.assert_close(shares.sum(dim=1), torch.tensor(reach))
    assert cache.length == before[2]
    rows = before[2]
    assert torch.equal(cache.keys[:, :, :rows], before[0][:, :, :rows])
    assert torch.equal(cache.values[:, :, :rows], before[1][:, :, :rows])


def test_refresh_in_place_equals_the_copy(case):
    model, fusion_input, prefix_cache, _ = case
    strategy = Probe(ratio=0.1, min_rows=0, refresh_ratio=0.2, draft_tokens=3)
    copied = strategy.fuse(model, fusion_input, prefix_cache, 8)
    prefix = prefix_cache.clone(extra_capacity=8)
    in_place = strategy.fuse(model, fusion_input, prefix, 8, in_place=True)
    assert in_place.cache is prefix
    torch.testing.assert_close(in_place.logits, copied.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(in_place.final_rows, copied.final_rows)


def test_refresh_settings_are_validated():
    assert build_strategy("probe:refresh_ratio=0.05,draft_tokens=4,refresh_rerun=true") == Probe(
        refresh_ratio=0.05, draft_tokens=4, refresh_rerun=True
    )
    with pytest.raises(ValueError, match="refresh_ratio must be in"):
        Probe(refresh_ratio=1.5)
    with pytest.raises(ValueError, match="refresh_ratio must be in"):
        build_strategy("probe:refresh_ratio=-0.1")
    with pytest.raises(ValueError, match="draft_tokens must be >= 1"):
        Probe(refresh_ratio=0.1, draft_tokens=0)
