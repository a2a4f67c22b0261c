"""The probe's escalation (ragkv.fusion.escalation) on the packaged SmolLM2, chunk KV in
float32: its preview is the question run over the placed cache, an escalated fuse is the
single pass at the escalated ratio, and below the threshold nothing changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fusion_cases import fused_case

from ragkv.fusion import LoadedChunk, Probe
from ragkv.fusion.fidelity import next_token_kl

CLOSE = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def case(engine):
    return engine, *fused_case(engine)


def _fuse(engine, strategy, fusion_input):
    return strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache())


def test_the_preview_is_the_question_over_the_placed_cache(case):
    """The selection pass's logits equal a fuse that recomputes the question rows alone."""
    engine, fusion_input, _ = case
    preview = _fuse(engine, Probe(ratio=0.2, min_rows=0, escalate_kl=1e9), fusion_input).preview
    question_only = _fuse(engine, Probe(ratio=0.0, min_rows=0, escalate_kl=0), fusion_input)
    torch.testing.assert_close(preview.logits, question_only.logits, **CLOSE)
    assert preview.scores.numel() == question_only.layout.num_reused_document_tokens


def test_an_escalated_fuse_is_the_single_pass_at_the_escalated_ratio(case):
    engine, fusion_input, reference = case
    escalated = _fuse(engine, Probe(ratio=0.1, min_rows=0, escalate_kl=1e-12, escalate_ratio=0.5), fusion_input)
    single = _fuse(engine, Probe(ratio=0.5, min_rows=0, escalate_kl=0), fusion_input)
    assert escalated.selection["escalated"] == 1.0
    assert escalated.selection["preview_kl"] > 0
    assert torch.equal(escalated.final_rows.cpu(), single.final_rows.cpu())
    assert escalated.recomputed_tokens == single.recomputed_tokens == round(0.5 * escalated.layout.num_document_tokens)
    assert escalated.recomputed_tokens + escalated.reused_tokens == escalated.layout.num_document_tokens
    torch.testing.assert_close(escalated.logits, single.logits, **CLOSE)
    rows = escalated.layout.length
    torch.testing.assert_close(escalated.cache.keys[:, :, :rows], single.cache.keys[:, :, :rows], **CLOSE)
    # and it is closer to the full prefill than the first pass alone
    first = _fuse(engine, Probe(ratio=0.1, min_rows=0, escalate_kl=0), fusion_input)
    assert next_token_kl(reference, escalated.logits) < next_token_kl(reference, first.logits)


def test_below_the_threshold_the_fuse_is_left_as_it_was(case):
    engine, fusion_input, _ = case
    kept = _fuse(engine, Probe(ratio=0.1, min_rows=0, escalate_kl=1e9), fusion_input)
    plain = _fuse(engine, Probe(ratio=0.1, min_rows=0, escalate_kl=0), fusion_input)
    assert kept.selection["escalated"] == 0.0
    assert kept.selection["preview_kl"] == pytest.approx(next_token_kl(kept.logits, kept.preview.logits))
    assert torch.equal(kept.final_rows.cpu(), plain.final_rows.cpu())
    torch.testing.assert_close(kept.logits, plain.logits, atol=0, rtol=0)


def test_no_escalation_where_every_row_is_recomputed_already(case):
    """Fewer document rows than min_rows: all of them are recomputed, no selection pass runs."""
    engine, fusion_input, reference = case
    result = _fuse(engine, Probe(min_rows=10**6, escalate_kl=1e-12), fusion_input)
    assert result.preview.logits is None and "escalated" not in result.selection
    torch.testing.assert_close(result.logits, reference, **CLOSE)


@pytest.mark.parametrize("settings", [dict(escalate_kl=-0.1), dict(escalate_ratio=1.5), dict(escalate_kl=float("nan"))])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError, match="escalate"):
        Probe(**settings)


def test_with_new_passages_the_comparison_reads_the_previews_rows_and_leaves_the_cache(case):
    """A fresh chunk is not computed when the pass runs: its rows are left out of the preview,
    so the fused side is measured over the same rows, and the question's K/V that measure
    writes are put back (the fuse is then exactly the one without the check)."""
    engine, fusion_input, _ = case
    chunks = list(fusion_input.chunks)
    chunks[1] = LoadedChunk(chunks[1].token_ids)
    with_fresh = dataclasses.replace(fusion_input, chunks=chunks)
    checked = _fuse(engine, Probe(ratio=0.1, min_rows=0, escalate_kl=1e9), with_fresh)
    plain = _fuse(engine, Probe(ratio=0.1, min_rows=0, escalate_kl=0), with_fresh)
    columns = checked.preview.columns
    assert columns is not None and not torch.isin(checked.layout.fresh_rows, columns).any()
    torch.testing.assert_close(checked.logits, plain.logits, atol=0, rtol=0)
    rows = checked.layout.length
    torch.testing.assert_close(checked.cache.keys[:, :, :rows], plain.cache.keys[:, :, :rows], atol=0, rtol=0)
    torch.testing.assert_close(checked.cache.values[:, :, :rows], plain.cache.values[:, :, :rows], atol=0, rtol=0)
    # over every row the fused logits would differ from the preview by the fresh chunk's share too
    assert checked.selection["preview_kl"] < next_token_kl(checked.logits, checked.preview.logits)


def test_a_fuse_that_recomputed_more_than_the_escalated_share_is_not_checked(case):
    engine, fusion_input, _ = case
    result = _fuse(engine, Probe(ratio=0.6, min_rows=0, escalate_kl=1e-12, escalate_ratio=0.5), fusion_input)
    assert "preview_kl" not in result.selection
    assert result.recomputed_tokens == round(0.6 * result.layout.num_document_tokens)
