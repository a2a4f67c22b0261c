"""The scheduler against one-at-a-time decoding: requests of mixed prompt lengths, admitted
at different steps and decoded in batches, give the tokens and text each gives alone, and
the streamed text is the tokenizer's decoding of the whole answer."""

from __future__ import annotations

import pytest

from ragkv.app.generate import CollectingSink, complete
from ragkv.app.request import Phase, Prepared, Request, RequestCancelled
from ragkv.app.scheduler import QueueFull, Scheduler, SchedulerConfig
from ragkv.app.usage import TokenUsage
from ragkv.engine.generation import GenerationConfig

pytestmark = pytest.mark.model

QUESTIONS = [
    "Name three colours.",
    "Write one sentence about the sea and the ships that sail on it in winter.",
    "What is 2 + 2?",
    "List the days of the week, starting from Monday, and say which ones are the weekend.",
]


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _request(engine, question: str, max_new_tokens: int, sink, **options) -> Request:
    def prepare(request: Request) -> Prepared:
        ids = engine.prompt.encode_messages(_messages(question))
        cache, logits = engine.prefill(ids, max_new_tokens)
        return Prepared(cache, logits, TokenUsage(prompt_tokens=len(ids)), "none")

    return Request("test", prepare, GenerationConfig(max_new_tokens=max_new_tokens), sink, **options)


class RecordingSink(CollectingSink):
    pass


def test_batched_decode_equals_one_at_a_time(engine):
    lengths = (24, 9, 24, 16)
    alone = []
    for question, n in zip(QUESTIONS, lengths):
        done = complete(engine, engine.prompt.encode_messages(_messages(question)), GenerationConfig(max_new_tokens=n))
        alone.append((done.token_ids, engine.tokenizer.decode(done.token_ids, skip_special_tokens=True)))

    scheduler = Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids, SchedulerConfig(max_running=4))
    sinks = [RecordingSink() for _ in QUESTIONS]
    for question, n, sink in zip(QUESTIONS, lengths, sinks):
        scheduler.add(_request(engine, question, n, sink))
    batch_sizes = []
    while scheduler.has_work:
        scheduler.step()
        batch_sizes.append(len(scheduler.running))
    assert max(batch_sizes) == 4  # all four decoded in one batch at some step

    for sink, (ids, text) in zip(sinks, alone):
        assert sink.error is None
        assert sink.completion.token_ids == ids
        assert "".join(sink.pieces) == text  # incremental detokenization = decoding the whole answer
        assert sink.completion.text == text.strip()
        assert sink.completion.usage.completion_tokens == len(ids) and sink.completion.timings.ttft > 0


def test_admission_respects_the_token_budget_and_queue_bound(engine):
    scheduler = Scheduler(
        engine.model,
        engine.tokenizer,
        engine.eos_token_ids,
        SchedulerConfig(max_running=4, max_waiting=2, token_budget=80),
    )
    sinks = [RecordingSink() for _ in range(2)]
    for sink in sinks:
        scheduler.add(_request(engine, QUESTIONS[0], 8, sink, estimated_tokens=40))
    with pytest.raises(QueueFull):
        scheduler.add(_request(engine, QUESTIONS[0], 8, RecordingSink()))
    running = []
    while scheduler.has_work:
        scheduler.step()
        running.append(len(scheduler.running))
    # One request holds ~40 prompt + 8 answer rows; a second (estimate 48) does not fit in 80
    # beside it, so it waits until the first is done (one request is always admitted).
    assert max(running) == 1 and all(sink.completion is not None for sink in sinks)


def test_a_cancelled_request_is_dropped_and_its_cache_freed(engine):
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids)
    gone, stays = RecordingSink(), RecordingSink()
    dropped = []
    request = _request(engine, QUESTIONS[1], 32, gone, on_dropped=dropped.append)
    scheduler.add(request)
    scheduler.add(_request(engine, QUESTIONS[2], 8, stays))
    scheduler.step()
    scheduler.step()
    assert request.phase is Phase.DECODING and request.cache is not None
    gone.cancelled = True
    scheduler.step()
    assert request.phase is Phase.FINISHED and request.cache is None and dropped == [request]
    assert isinstance(gone.error, RequestCancelled)
    scheduler.run_until_done()
    assert stays.completion is not None and gone.completion is None
