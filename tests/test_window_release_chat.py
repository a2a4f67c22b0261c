"""Chat turns over a context whose sliding-window layers released rows in decode, on a tiny
random Gemma 3 (window 8) with the packaged tokenizer: a follow-up that appends to the
context reuses it and its first token is that of a full recomputation; a conversation that
diverges before the released rows is recomputed, never read from rows the cache let go."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_weights
from transformers import AutoTokenizer

from ragkv.app.chat.contexts import ContextCache
from ragkv.app.chat.turn import ChatTurn, ChatTurns
from ragkv.app.generate import run_alone
from ragkv.app.rag import QueryConfig
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.model import CausalLM
from ragkv.engine.model_files import resolve_model_dir
from ragkv.engine.prompt import ChatPrompt

pytestmark = pytest.mark.model  # the packaged SmolLM2 tokenizer or model

CONFIG = QueryConfig(generation=GenerationConfig(max_new_tokens=6))
LONG = " ".join(f"word{i}" for i in range(30))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    reference = tiny_weights("gemma3", scale_only=True, vocab_size=len(tokenizer))
    folder = tmp_path_factory.mktemp("gemma3-chat")
    reference.save_pretrained(folder)
    model = CausalLM.load(folder)
    prompt = ChatPrompt(tokenizer, "Answer briefly.")
    return SimpleNamespace(
        model=model,
        tokenizer=tokenizer,
        prompt=prompt,
        tokenize=prompt.encode,
        spec=model.spec,
        eos_token_ids=set(),
        fingerprint="tiny-gemma3",
    )


def _turn(engine, turns, messages, session_id=None, context_id=None):
    request = turns.request(ChatTurn("t", messages, session_id, False, CONFIG), context_id=context_id)
    return run_alone(engine, request)


def _recomputed_first_token(engine, ids: list[int]) -> int:
    cache = engine.model.new_cache(len(ids))
    return int(engine.model.prefill(torch.tensor(ids), cache).argmax())


def test_chat_turns_keep_every_row_by_default(engine):
    """A held chat context stays whole unless asked: a follow-up may fuse a new chunk into it."""
    turns = ChatTurns(SimpleNamespace(engine=engine), ContextCache(1 << 30, 1 << 30, 600))
    _turn(engine, turns, [{"role": "user", "content": f"Tell me about {LONG}."}], context_id="sess_k")
    context = turns.contexts.get("t", "sess_k")
    assert context.length > engine.spec.sliding_window and not context.cache.trimmed


def test_follow_ups_extend_a_released_context_and_a_divergent_one_recomputes(engine):
    contexts = ContextCache(1 << 30, 1 << 30, 600)
    turns = ChatTurns(SimpleNamespace(engine=engine), contexts, release_window_rows=True)
    first = [{"role": "user", "content": f"Tell me about {LONG}."}]
    done = _turn(engine, turns, first, context_id="sess_a")
    context = turns.contexts.get("t", "sess_a")
    assert context.cache.trimmed and context.cache.first_row(0) > 0  # the decode released rows
    held = context.length

    # a follow-up that appends to the context: reused whole, first token as recomputed
    follow = _turn(engine, turns, [{"role": "user", "content": f"And {LONG}?"}], session_id="sess_a")
    context = turns.contexts.get("t", "sess_a")
    assert follow.usage.cached_tokens == held and follow.info.turn == 2
    prompt_ids = context.row_ids[: follow.usage.prompt_tokens]
    assert follow.token_ids[0] == _recomputed_first_token(engine, prompt_ids)
    assert context.cache.first_row(0) > held  # released again past the first turn's rows

    # the first message edited at its end: the common prefix stops before the released rows
    edited = [{"role": "user", "content": f"Tell me about {LONG}!"}]
    match = turns.contexts.match("t", engine.fingerprint, engine.prompt.encode_messages(edited))
    assert match is not None and context.rows_for(match.conversation_tokens) < context.cache.earliest_cut
    diverged = _turn(engine, turns, edited)
    assert diverged.usage.cached_tokens == 0 and diverged.usage.prompt_tokens > 0
    ids = engine.prompt.encode_messages(edited)
    assert diverged.token_ids[0] == _recomputed_first_token(engine, ids)
    assert done.token_ids and follow.token_ids
