"""A chat session's later turns are an exact prefix continuation: the KV the session holds
after three turns equals a plain full prefill of the whole conversation, and so does the
answer. Runs the service's chat body in-process on the packaged engine (no HTTP)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ragkv.api.config import ServeConfig
from ragkv.api.metrics import Metrics
from ragkv.api.service import Service
from ragkv.api.sessions import MemorySessions
from ragkv.engine.generation import GenerationConfig
from ragkv.app.rag import QueryConfig

pytestmark = pytest.mark.model


class _Job:
    kind = "chat"
    queue_seconds = 0.0


def _run(body):
    generator, items = body(_Job()), []
    try:
        while True:
            items.append(next(generator))
    except StopIteration as stop:
        return stop.value, items


def test_later_turns_continue_the_cache_exactly(engine):
    sessions = MemorySessions(1 << 30, 600)
    service = Service(SimpleNamespace(engine=engine, rag=None, registry=None), ServeConfig(), Metrics(), sessions)
    config = QueryConfig(generation=GenerationConfig(max_new_tokens=6))
    outcomes = []
    for question in ("Name a colour.", "Name another one.", "And a third?"):
        message = {"role": "user", "content": question}
        outcome, items = _run(service.chat_body("default", "s", [message], False, config))
        assert items[0][0] == "prepared" and "".join(v for k, v in items if k == "token").strip() == outcome.text
        outcomes.append(outcome)
    assert [o.session["turns"] for o in outcomes] == [1, 2, 3]
    # Turn N+1 computes only the previous answer and the new message.
    for before, after in zip(outcomes, outcomes[1:]):
        assert after.usage["reused_tokens"] == before.usage["prompt_tokens"]
        assert after.usage["computed_tokens"] == after.usage["prompt_tokens"] - before.usage["prompt_tokens"] < 40

    session = sessions.checkout("default", "s")
    try:
        assert session.length == len(session.token_ids) == outcomes[-1].usage["prompt_tokens"]
        cache, logits = engine.prefill(session.token_ids, 8)
        torch.testing.assert_close(session.cache.keys[:, :, : session.length], cache.keys[:, :, : session.length],
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(session.cache.values[:, :, : session.length], cache.values[:, :, : session.length],
                                   atol=1e-4, rtol=1e-4)
        reference = "".join(event.text for event in engine.stream(cache, logits, config.generation))
        assert reference == session.last_answer
    finally:
        sessions.release("default", "s", session)
