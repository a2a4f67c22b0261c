"""Chat turns on the packaged engine (no HTTP): a client that resends the whole history
with no session id reuses the longest cached prefix and computes only the new tokens, and
the answer equals a plain full prefill of the conversation; roles and the user's system
prompt go through the chat template; sessions are handles (unknown = not found); tenants
never share a context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ragkv.app.chat.contexts import ContextCache, SessionNotFoundError
from ragkv.app.chat.turn import ChatTurn, ChatTurns
from ragkv.app.generate import CollectingSink, complete, run_alone
from ragkv.app.rag import QueryConfig
from ragkv.app.scheduler import Scheduler
from ragkv.engine.generation import GenerationConfig
from ragkv.errors import InputError

pytestmark = pytest.mark.model

CONFIG = QueryConfig(generation=GenerationConfig(max_new_tokens=6))


@pytest.fixture()
def turns(engine):
    return ChatTurns(SimpleNamespace(engine=engine), ContextCache(1 << 30, 1 << 30, 600))


def _turn(engine, turns: ChatTurns, messages, tenant="default", session_id=None):
    return run_alone(engine, turns.request(ChatTurn(tenant, messages, session_id, False, CONFIG)))


def test_resent_history_reuses_the_longest_prefix_and_decodes_like_a_full_prefill(engine, turns):
    messages = [{"role": "system", "content": "You answer in few words."}]
    completions = []
    for question in ("Name a colour.", "Name another one.", "And a third?"):
        messages.append({"role": "user", "content": question})
        completion = _turn(engine, turns, list(messages))
        completions.append(completion)
        messages.append({"role": "assistant", "content": completion.text})
    for before, after in zip(completions, completions[1:]):
        # Everything of the previous turn's prompt is cached (and most of its answer).
        assert after.usage.cached_tokens >= before.usage.prompt_tokens
        assert after.usage.computed_tokens < 30 and after.info.turn == before.info.turn + 1

    # The last turn's prompt is the chat template's rendering of the messages, roles and
    # the user's system prompt kept, and its answer is that of a plain full prefill.
    ids = engine.prompt.encode_messages(messages[:-1])
    assert engine.tokenizer.decode(ids).startswith("<|im_start|>system\nYou answer in few words.<|im_end|>")
    assert completions[-1].usage.prompt_tokens == len(ids)
    cache, _ = engine.prefill(ids, 8)
    reference = complete(engine, ids, CONFIG.generation).text.strip()
    assert completions[-1].text == reference

    context = turns.contexts.match("default", engine.fingerprint, ids).context
    rows = len(ids)
    torch.testing.assert_close(context.cache.keys[:, :, :rows], cache.keys[:, :, :rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(context.cache.values[:, :, :rows], cache.values[:, :, :rows], atol=1e-4, rtol=1e-4)


def test_sessions_are_handles_and_tenants_never_share(engine, turns):
    first = [{"role": "user", "content": "Name a colour."}]
    done = _turn(engine, turns, first)
    session_id = done.info.session_id
    follow = _turn(engine, turns, [{"role": "user", "content": "Another?"}], session_id=session_id)
    assert follow.info.turn == 2 and follow.usage.cached_tokens >= done.usage.prompt_tokens
    with pytest.raises(SessionNotFoundError):
        _turn(engine, turns, first, session_id="sess_unknown")
    with pytest.raises(SessionNotFoundError):
        _turn(engine, turns, first, tenant="other", session_id=session_id)
    elsewhere = _turn(engine, turns, first, tenant="other")
    assert elsewhere.usage.cached_tokens == 0 and elsewhere.text == done.text


def _session_state(turns: ChatTurns, session_id: str):
    context = turns.contexts.checkout("default", session_id)
    try:
        rows = context.cache.length
        return (
            list(context.conversation_ids),
            list(context.row_ids),
            rows,
            context.turns,
            context.cache.keys[:, :, :rows].clone(),
            context.cache.values[:, :, :rows].clone(),
        )
    finally:
        turns.contexts.release("default", session_id, context)


def _assert_same_session(before, after) -> None:
    assert after[:4] == before[:4]  # ids, rows, length, turns
    assert torch.equal(after[4], before[4]) and torch.equal(after[5], before[5])


def test_a_failed_or_cancelled_turn_leaves_its_session_whole(engine, turns):
    """A history that diverges from the stored session makes the turn reuse only the common
    prefix; whether the turn then fails or is cancelled mid-answer, the session keeps every
    row it had, with the same keys and values."""
    first = _turn(engine, turns, [{"role": "user", "content": "Name a colour."}])
    session_id = first.info.session_id
    _turn(engine, turns, [{"role": "user", "content": "Name another one."}], session_id=session_id)
    before = _session_state(turns, session_id)
    diverging = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Something else entirely, said at some length."},
        {"role": "user", "content": "Why that one?"},
    ]

    too_long = QueryConfig(generation=GenerationConfig(max_new_tokens=engine.spec.rope.max_position_embeddings))
    with pytest.raises(InputError) as refused:  # refused as the turn is built, before any store read
        turns.request(ChatTurn("default", diverging, session_id, False, too_long))
    assert refused.value.reason == "context_length_exceeded"
    _assert_same_session(before, _session_state(turns, session_id))
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids)

    request = turns.request(
        ChatTurn("default", diverging, session_id, False, QueryConfig(generation=GenerationConfig(max_new_tokens=32)))
    )
    sink = CollectingSink()
    request.sink = sink
    scheduler.add(request)
    while len(request.output_ids) < 3:  # the turn's prompt and a few answer rows are written
        scheduler.step()
    sink.cancelled = True
    scheduler.run_until_done()
    assert sink.completion is None and sink.error is not None
    _assert_same_session(before, _session_state(turns, session_id))

    third = _turn(engine, turns, [{"role": "user", "content": "And a third?"}], session_id=session_id)
    assert third.info.turn == 3 and third.usage.cached_tokens >= before[2] - 1
