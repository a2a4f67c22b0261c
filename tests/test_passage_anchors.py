"""Reuse below the span: anchors find the stretch two prompts share inside passages that
differ (chunks a splitter cut with overlap, sources wrapped in one-line tags), the store
gives exactly those rows, only new rows are stored, and the answer stays near the full
prefill. Real LMDB store, the packaged SmolLM2 (float32 reference numerics)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ragkv.app.chat.conversation import render_conversation
from ragkv.app.passages import PromptPassages, SpanConfig
from ragkv.app.passages.anchors import AnchorConfig, anchor_positions, extend
from ragkv.bench.prompt_shapes import SHAPES, Passage
from ragkv.engine.kv_storage import KV_STORAGE_FORMATS, dense, slice_tokens
from ragkv.fusion import build_strategy
from ragkv.fusion.fidelity import next_token_kl
from ragkv.store.url import open_store

SENTENCES = [
    "The Varnholt canal was dug between 1791 and 1803 to carry peat from the moors to the coast.",
    "Its locks were rebuilt in stone after the flood of 1846 broke the timber gates at Esterwald.",
    "Barges drawn by horses took four days from the moor villages to the harbour at Lunden.",
    "Traffic fell after the railway reached Lunden in 1879, and the upper reach closed in 1921.",
    "A volunteer trust reopened nine kilometres for pleasure boats in 1998 with a grant from the county.",
    "The lock keeper's cottage at Esterwald is now a museum of the peat trade and its tools.",
    "Otters returned to the lower reach in the 2010s, after the water board cleaned the feeder streams.",
    "The towpath is part of a long-distance cycle route that follows the canal to the sea.",
]
QUESTION = "When did the railway reach Lunden?"


def _messages(chunks: list[str], question: str = QUESTION) -> list[dict[str, str]]:
    return SHAPES["blank_lines"].messages([Passage(c, "", i) for i, c in enumerate(chunks, 1)], question)


# -- slicing stored KV -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["float32", "float16", "int8", "int4"])
@pytest.mark.parametrize("rows", [(0, 300), (5, 77), (128, 256), (250, 301), (0, 1), (300, 301)])
def test_a_slice_of_a_stored_run_is_the_slice_of_its_dense_rows(name, rows):
    kv_format = KV_STORAGE_FORMATS[name]
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, 3, 301, 64, generator=generator) for _ in range(2))
    stored_keys, stored_values = kv_format.unpack(kv_format.pack(keys, values))
    start, end = rows
    for stored in (stored_keys, stored_values):
        part = slice_tokens(stored, start, end)
        assert part.shape[2] == end - start
        torch.testing.assert_close(dense(part, torch.float32), dense(stored, torch.float32)[:, :, start:end])


def test_a_slice_outside_the_run_is_refused():
    stored = torch.zeros(1, 1, 10, 4)
    with pytest.raises(ValueError, match="outside"):
        slice_tokens(stored, 4, 11)


# -- anchors -----------------------------------------------------------------------------


def test_every_shared_stretch_of_the_guaranteed_length_holds_a_common_anchor():
    config = AnchorConfig()
    rng = np.random.default_rng(0)
    misses = 0
    for _ in range(300):
        shared = rng.integers(0, 49152, config.guaranteed + int(rng.integers(0, 40)))
        before_a, before_b = (rng.integers(0, 49152, int(rng.integers(0, 80))) for _ in range(2))
        a = np.concatenate([before_a, shared, rng.integers(0, 49152, 30)])
        b = np.concatenate([before_b, shared, rng.integers(0, 49152, 30)])

        def inside(ids, offset):
            # anchors whose whole window lies in the shared stretch, as offsets into it
            return {
                int(p) - offset
                for p in anchor_positions(ids, config)
                if offset + config.window - 1 <= p < offset + len(shared)
            }

        misses += not inside(a, len(before_a)) & inside(b, len(before_b))
    assert misses == 0


def test_anchors_are_a_small_share_of_positions():
    config = AnchorConfig()
    ids = np.random.default_rng(1).integers(0, 49152, 20_000)
    density = len(anchor_positions(ids, config)) / len(ids)
    assert 1 / (config.winnow + 1) < density < 3 / (config.winnow + 1)


def test_extend_grows_an_aligned_pair_to_the_whole_shared_stretch():
    run = np.arange(100, 200)
    ids = np.concatenate([np.arange(0, 10), run[20:70], np.arange(900, 910)])
    assert extend(ids, 30, run, 40, 0, len(ids)) == (10, 60)  # ids[10:60] == run[20:70]
    assert extend(ids, 30, run, 41, 0, len(ids)) == (30, 30)  # misaligned: nothing
    assert extend(ids, 30, run, 40, 15, 50) == (15, 50)  # held inside [low, high)


def test_a_bad_anchor_config_is_refused():
    with pytest.raises(ValueError):
        AnchorConfig(window=2)
    with pytest.raises(ValueError):
        AnchorConfig(window=16, min_match=8)


# -- the store, the model ----------------------------------------------------------------


@pytest.fixture
def passages(engine, tmp_path):
    store = open_store(f"lmdb://{tmp_path / 'store'}")
    yield PromptPassages(engine, store, SpanConfig(min_tokens=24))
    store.close()


def _fuse(passages: PromptPassages, tenant: str, ids: list[int]):
    return passages.prepare_prompt(tenant, ids, build_strategy("probe"), 8)


def _stored_bytes(passages: PromptPassages) -> int:
    return passages.store.stats().bytes


def test_overlapping_chunks_reuse_the_rows_they_share_and_store_only_new_rows(engine, passages):
    # a splitter's two cuts of one document: chunk edges move, the middle sentences recur
    first_chunks = [" ".join(SENTENCES[0:3]), " ".join(SENTENCES[2:5]), " ".join(SENTENCES[4:7])]
    second_chunks = [" ".join(SENTENCES[5:8]), " ".join(SENTENCES[1:4]), " ".join(SENTENCES[3:6])]
    first = render_conversation(engine.prompt, _messages(first_chunks)).token_ids
    second = render_conversation(engine.prompt, _messages(second_chunks, "Who reopened the canal?")).token_ids

    cold = _fuse(passages, "alice", first)
    assert cold.plan.placed == [] or all(p.run in cold.plan.digests for p in cold.plan.placed)
    stored_after_first = _stored_bytes(passages)

    warm_plan = passages.plan("alice", second, 0)
    assert warm_plan is not None and warm_plan.placed
    placed_ids = [tuple(second[p.start : p.end]) for p in warm_plan.placed]
    joined = " ".join(engine.tokenizer.decode(list(t)) for t in placed_ids)
    # the sentences both cuts hold were found (SENTENCES[1:7] are in the first prompt)
    for sentence in SENTENCES[1:7]:
        assert sentence.split(" ", 2)[2][:30] in joined, sentence
    # SENTENCES[7] is new: never placed
    assert SENTENCES[7][:40] not in joined
    # each placed piece's rows are the stored run's rows of those tokens
    for piece in warm_plan.placed:
        assert piece.end - piece.start >= passages.anchors.min_match
        assert piece.keys.shape[2] == piece.end - piece.start
    warm = passages.prepare_prompt("alice", second, build_strategy("probe"), 8, plan=warm_plan)
    _, reference = engine.prefill(second)
    assert next_token_kl(reference, warm.fusion.logits) < 0.1

    # only the rows no stored run held were stored: far less than the second prompt's passages
    new_tokens = sum(e - s for span in warm_plan.spans for s, e in warm_plan.uncovered(span))
    passage_tokens = sum(len(s) for s in warm_plan.spans)
    assert new_tokens < 0.5 * passage_tokens
    grown = _stored_bytes(passages) - stored_after_first
    per_token = stored_after_first / sum(len(s) for s in cold.plan.spans)
    assert grown < 1.5 * per_token * new_tokens + 4096


def test_placed_rows_equal_the_rows_stored_from_the_first_prompt(engine, passages):
    chunks = [" ".join(SENTENCES[0:4]), " ".join(SENTENCES[4:8])]
    first = render_conversation(engine.prompt, _messages(chunks)).token_ids
    _fuse(passages, "alice", first)
    # the same sentences, cut elsewhere, under Open WebUI's one-line source tags
    recut = [" ".join(SENTENCES[0:2]), " ".join(SENTENCES[2:6]), " ".join(SENTENCES[6:8])]
    shape = SHAPES["open_webui"]
    second = render_conversation(
        engine.prompt, shape.messages([Passage(c, f"canal {i}", i) for i, c in enumerate(recut, 1)], QUESTION)
    ).token_ids
    plan = passages.plan("alice", second, 0)
    assert plan is not None
    covered = sum(p.end - p.start for p in plan.placed)
    assert covered >= 0.8 * sum(len(engine.tokenize(s)) for s in SENTENCES)
    for piece in plan.placed:
        stored = passages.store.get_many([passages.keys.chunk_keys.key("alice", piece.run)])[0]
        run_ids = stored["tokens"].tolist()
        pieces_ids = second[piece.start : piece.end]
        offset = next(i for i in range(len(run_ids)) if run_ids[i : i + len(pieces_ids)] == pieces_ids)
        run_keys, _ = engine.kv_format.unpack(stored)
        torch.testing.assert_close(
            dense(piece.keys, torch.float32), dense(run_keys, torch.float32)[:, :, offset : offset + len(pieces_ids)]
        )


def test_another_tenant_never_reuses_the_rows(engine, passages):
    chunks = [" ".join(SENTENCES[0:4]), " ".join(SENTENCES[4:8])]
    ids = render_conversation(engine.prompt, _messages(chunks)).token_ids
    _fuse(passages, "alice", ids)
    recut = [" ".join(SENTENCES[1:5]), " ".join(SENTENCES[5:8])]
    other = render_conversation(engine.prompt, _messages(recut)).token_ids
    assert passages.plan("alice", other, 0).placed
    assert passages.plan("bob", other, 0).placed == []


def test_a_prompt_of_new_text_is_exact_and_places_nothing(engine, passages):
    rng = random.Random(3)
    words = [" ".join(rng.choice(SENTENCES).split()[::-1]) for _ in range(6)]
    ids = render_conversation(engine.prompt, _messages(words)).token_ids
    fused = _fuse(passages, "alice", ids)
    assert fused.plan.placed == []
    _, reference = engine.prefill(ids)
    torch.testing.assert_close(fused.fusion.logits, reference, atol=1e-4, rtol=1e-4)
