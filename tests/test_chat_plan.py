"""A chat turn's plan (ragkv.app.chat.plan) as a pure function of its opening, the chunks
retrieved and the passage lookup: no model, the base context's cache only holds rows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ragkv.app.chat.contexts import Context, Insertion
from ragkv.app.chat.conversation import Conversation
from ragkv.app.chat.plan import (
    NO_BASE,
    Base,
    FuseChunks,
    FusePassages,
    Opening,
    PrefillTail,
    TurnIds,
    plan_turn,
)
from ragkv.app.passages import PassagePlan, Span
from ragkv.engine.kv_cache import KVCache

IDS = TurnIds(instruction=[900, 901], lead=[950], chunk_prefix=[1, 2, 3])


@dataclass(frozen=True)
class _Chunk:
    chunk_hash: str
    token_start: int
    token_end: int


def retrieved(*chunks: _Chunk) -> list:
    return [("record", chunk, 1.0) for chunk in chunks]


def context(conversation_ids: list[int], row_ids: list[int], insertions=(), created: float = 5.0) -> Context:
    cache = KVCache(torch.zeros(1, 1, len(row_ids) + 4, 2), torch.zeros(1, 1, len(row_ids) + 4, 2), len(row_ids))
    return Context("ctx", "t", "fp", list(conversation_ids), list(row_ids), cache, list(insertions), created=created)


def plan(opening, found=(), lookup=None, session=False):
    return plan_turn(opening, list(found), IDS, lookup=lookup, context_id="new", session=session)


def test_a_turn_without_a_base_prefills_its_whole_conversation():
    conversation = Conversation([1, 2, 3, 10, 11, 12, 4], 3, 6)
    result = plan(Opening(conversation, NO_BASE, 1))
    assert result.work == PrefillTail([1, 2, 3, 10, 11, 12, 4])
    assert result.reuse.conversation_tokens == 0 and result.reuse.rows == 0 and result.new_chunks == 0
    assert (result.save.context_id, result.save.session, result.save.turns, result.save.created) == (
        "new",
        False,
        1,
        None,
    )


def test_a_follow_up_prefills_only_past_its_held_prefix_and_keeps_the_base_creation_time():
    base = context([1, 2, 3, 10, 4, 20], [1, 2, 3, 10, 4, 20], created=7.0)
    conversation = Conversation([1, 2, 3, 10, 4, 20, 5, 30, 31, 4], 7, 9)
    result = plan(Opening(conversation, Base(base, 6, True), 2), session=True)
    assert result.reuse.conversation_tokens == 6 and result.reuse.row_ids == [1, 2, 3, 10, 4, 20]
    assert result.work == PrefillTail([5, 30, 31, 4])
    assert result.save.session and result.save.turns == 2 and result.save.created == 7.0


def test_the_whole_conversation_is_never_reused_one_token_is_left_to_give_logits():
    base = context([1, 2, 3], [1, 2, 3])
    result = plan(Opening(Conversation([1, 2, 3], 1, 2), Base(base, 3, False), 1))
    assert result.reuse.conversation_tokens == 2 and result.work == PrefillTail([3])
    assert result.save.created is None  # copied, not held: a new context


def test_a_new_chunk_is_fused_before_the_last_message_and_the_prefix_is_cut_there():
    # the base holds a chunk of 5 rows spliced in before conversation token 2
    base = context([1, 2, 3, 4, 5, 6], [1, 2, 7, 7, 7, 7, 7, 3, 4, 5, 6], [Insertion(2, 5, ("old",))])
    conversation = Conversation([1, 2, 3, 4, 5, 6, 40, 41, 9], 6, 8)
    new = _Chunk("new", 0, 12)
    result = plan(Opening(conversation, Base(base, 6, True), 2), retrieved(_Chunk("old", 0, 5), new))
    work = result.work
    assert isinstance(work, FuseChunks) and result.new_chunks == 1
    assert [chunk for _, chunk, _ in work.chunks] == [new]  # the held chunk is not fused again
    assert result.reuse.conversation_tokens == 6 and result.reuse.rows == 11
    assert result.reuse.insertions == [Insertion(2, 5, ("old",))]
    assert work.glue == [900, 901] and work.prefix_ids == base.row_ids + [900, 901]
    assert work.question_ids == [950, 40, 41, 9] and work.question_text == (1, 3)
    assert work.chunk_rows == 12 and not work.shared_prefix
    assert work.insertion(12) == Insertion(6, 2 + 12 + 1, ("new",))


def test_a_chunk_held_only_after_the_matched_point_is_fused_again():
    base = context([1, 2, 3, 4], [1, 2, 3, 8, 8, 4], [Insertion(3, 2, ("a",))])
    conversation = Conversation([1, 2, 3, 5, 6, 9], 3, 5)
    result = plan(Opening(conversation, Base(base, 3, False), 2), retrieved(_Chunk("a", 0, 2)))
    assert isinstance(result.work, FuseChunks) and result.reuse.rows == 3 and result.reuse.insertions == []


def test_a_conversation_that_is_the_shared_chunk_prefix_fuses_after_its_cache():
    conversation = Conversation([1, 2, 3, 40, 9], 3, 4)
    result = plan(Opening(conversation, NO_BASE, 1), retrieved(_Chunk("c", 0, 4), _Chunk("c", 0, 4)))
    work = result.work
    assert isinstance(work, FuseChunks) and len(work.chunks) == 1  # each chunk once
    assert work.glue == [1, 2, 3, 900, 901] and not work.shared_prefix
    bare = TurnIds(instruction=[], lead=[950], chunk_prefix=[1, 2, 3])
    opening = Opening(conversation, NO_BASE, 1)
    shared = plan_turn(opening, retrieved(_Chunk("c", 0, 4)), bare, lookup=None, context_id="new", session=False)
    assert shared.work.shared_prefix


def test_pasted_passages_are_looked_up_in_the_reused_rows_then_the_new_tokens():
    base = context([1, 2, 3], [1, 2, 8, 3], [Insertion(2, 1, ("x",))])
    conversation = Conversation([1, 2, 3, 60, 61, 62, 63, 64, 9], 4, 8)
    calls = []
    found = PassagePlan([Span(6, 8)], ["h"], [])

    def lookup(ids, start):
        calls.append((list(ids), start))
        return found

    result = plan(Opening(conversation, Base(base, 3, True), 2), lookup=lookup)
    assert calls == [([1, 2, 8, 3, 60, 61, 62, 63, 64, 9], 4)]
    assert result.work == FusePassages([1, 2, 8, 3, 60, 61, 62, 63, 64, 9], 4, found)
    assert result.work.passages.first == 6


def test_no_passages_found_falls_back_to_the_prefill():
    conversation = Conversation([1, 2, 3, 60, 9], 3, 4)
    result = plan(Opening(conversation, NO_BASE, 1), lookup=lambda ids, start: None)
    assert result.work == PrefillTail([1, 2, 3, 60, 9])


@pytest.mark.parametrize("fusing", [False, True])
def test_a_base_whose_windows_released_rows_is_reused_only_by_appending(fusing):
    base = context([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8])
    window = type("Window", (), {"start": 4, "window": 3, "layers": ()})()
    base.cache.window = window  # trimmed: rows before 4 released, a cut needs >= 6 rows
    conversation = Conversation([1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 9], 9, 10)
    found = retrieved(_Chunk("c", 0, 3)) if fusing else []
    appended = plan(Opening(conversation, Base(base, 8, True), 2), found, lookup=lambda ids, start: 1 / 0)
    if fusing:  # a fusion reads every layer's prefix rows: nothing is reused
        assert appended.reuse.rows == 0 and isinstance(appended.work, FuseChunks)
        assert appended.work.glue == [1, 2, 3, 4, 5, 6, 7, 8, 50, 900, 901]
    else:  # the whole base is appended to; no passages are looked for over released rows
        assert appended.reuse.rows == 8 and appended.work == PrefillTail([50, 51, 9])
    cut_early = plan(Opening(Conversation([1, 2, 3, 4, 60, 9], 4, 5), Base(base, 4, True), 2))
    assert cut_early.reuse.rows == 0 and cut_early.work == PrefillTail([1, 2, 3, 4, 60, 9])


def test_only_a_turn_that_retrieved_chunks_needs_the_fusion_ids():
    conversation = Conversation([1, 2, 3, 60, 9], 3, 4)
    opening = Opening(conversation, NO_BASE, 1)
    assert plan_turn(opening, [], None, lookup=None, context_id="new", session=False).work == PrefillTail(
        [1, 2, 3, 60, 9]
    )
    with pytest.raises(ValueError):
        plan_turn(opening, retrieved(_Chunk("c", 0, 4)), None, lookup=None, context_id="new", session=False)
