"""Admission, batching and the worker loop's fairness, decided by pure functions and run
against a stand-in model (no weights are loaded): `schedule` plans a scheduler step,
`plan_round` a round of the worker loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from scheduler_fakes import EOS, FakeCache, FakeModel, FakeTokenizer, logits

from ragkv.app.generate import CollectingSink
from ragkv.app.request import FinishReason, Prepared, Request, RequestCancelled
from ragkv.app.scheduler import QueueFull, Scheduler, SchedulerConfig, StepPlan, schedule
from ragkv.app.server.request_stream import RequestStream
from ragkv.app.server.task import Task
from ragkv.app.server.worker import LoopState, ModelWorker, plan_round
from ragkv.app.usage import TokenUsage
from ragkv.engine.generation import GenerationConfig


def _request(prompt_tokens: int = 8, max_new_tokens: int = 4, estimate: int = 0, fail: bool = False) -> Request:
    def prepare(request: Request) -> Prepared:
        if fail:
            raise ValueError("bad prompt")
        return Prepared(FakeCache(prompt_tokens), logits(0), TokenUsage(prompt_tokens=prompt_tokens), "none")

    sink = CollectingSink()
    sink.cancelled = False
    return Request("test", prepare, GenerationConfig(max_new_tokens=max_new_tokens), sink, estimated_tokens=estimate)


def _scheduler(model=None, **config) -> Scheduler:
    return Scheduler(model or FakeModel(), FakeTokenizer(), {EOS}, SchedulerConfig(**config))


# -- schedule: a plan from the queues ------------------------------------------------------------


def test_one_waiting_request_is_prepared_per_step_and_one_always_when_none_runs():
    config = SchedulerConfig(token_budget=10)
    first, second = _request(estimate=100), _request()
    plan = schedule([first, second], [], config)
    assert plan == StepPlan((), first, (first,), False)  # over the budget, but nothing runs
    assert schedule([], [], config, idle_work=True).idle
    assert not schedule([first], [], config, idle_work=True).idle  # a request goes first


def test_the_token_budget_and_the_batch_rows_bound_admission():
    running = [_request(estimate=30) for _ in range(2)]  # 30 + 4 answer tokens each, not prepared
    waiting = _request(estimate=10)  # 14 more
    assert schedule([waiting], running, SchedulerConfig(token_budget=82)).prepare is waiting
    assert schedule([waiting], running, SchedulerConfig(token_budget=81)).prepare is None
    full = schedule([waiting], running, SchedulerConfig(max_running=2))
    assert full.prepare is None and full.decode == tuple(running)


def test_requests_whose_client_went_away_are_dropped_not_admitted_nor_decoded():
    gone_waiting, stays, gone_running, running = _request(), _request(), _request(), _request()
    gone_waiting.sink.cancelled = gone_running.sink.cancelled = True
    plan = schedule([gone_waiting, stays], [gone_running, running], SchedulerConfig())
    assert plan.drop == (gone_waiting, gone_running)
    assert plan.prepare is stays and plan.decode == (running, stays)


def test_the_waiting_queue_is_bounded_all_or_none():
    scheduler = _scheduler(max_waiting=2)
    scheduler.add(_request())
    with pytest.raises(QueueFull):
        scheduler.add(_request(), _request())
    scheduler.add(_request())
    assert len(scheduler.waiting) == 2


# -- the scheduler with a stand-in model -----------------------------------------------------------


def test_requests_decode_in_one_batch_and_each_gets_its_tokens():
    model = FakeModel()
    scheduler = _scheduler(model, max_running=3)
    requests = [_request(max_new_tokens=n) for n in (5, 5, 3, 2)]
    scheduler.add(*requests)
    scheduler.run_until_done()
    assert max(model.batches) == 3  # max_running rows
    assert model.batches[:3] == [1, 2, 3]  # one prepare per step, each joining the batch
    for request, n in zip(requests, (5, 5, 3, 2)):
        completion = request.sink.completion
        assert completion.token_ids == list(range(n)) and completion.finish_reason is FinishReason.LENGTH
        assert completion.text == FakeTokenizer().decode(range(n))


def test_a_failed_prepare_or_a_cancelled_client_leaves_the_others_running():
    scheduler = _scheduler()
    bad, gone, good = _request(fail=True), _request(max_new_tokens=8), _request(max_new_tokens=3)
    scheduler.add(bad, gone, good)
    scheduler.step()
    scheduler.step()
    assert isinstance(bad.sink.error, ValueError) and scheduler.running == [gone]
    gone.sink.cancelled = True
    plan = scheduler.step()
    assert plan.drop == (gone,) and isinstance(gone.sink.error, RequestCancelled) and gone.cache is None
    scheduler.run_until_done()
    assert good.sink.completion.token_ids == [0, 1, 2]


def test_a_failed_decode_step_fails_its_rows_only():
    class Broken(FakeModel):
        def decode_batch(self, *args, **kwargs):
            raise RuntimeError("out of memory")

    scheduler = _scheduler(Broken())
    request = _request()
    scheduler.add(request)
    scheduler.step()
    assert isinstance(request.sink.error, RuntimeError) and not scheduler.has_work


# -- the worker loop: fairness between tasks and requests ---------------------------------------------


def test_interactive_work_goes_first_and_a_started_background_task_still_steps():
    query, ingestion, queued = object(), object(), object()
    plan = plan_round(LoopState(active=(query,), queued_background=queued, scheduler_busy=True), 5.0)
    assert plan.tasks == (query,) and plan.background is None and plan.scheduler  # not started under load
    assert plan_round(LoopState(queued_background=queued), 5.0).background is queued  # started when idle
    under_load = LoopState(background=ingestion, scheduler_busy=True, background_waited_s=1.0)
    assert plan_round(under_load, 5.0).background is None and plan_round(under_load, 5.0).scheduler
    waited = LoopState(background=ingestion, scheduler_busy=True, background_waited_s=5.0)
    assert plan_round(waited, 5.0).background is ingestion and plan_round(waited, 5.0).scheduler
    assert plan_round(LoopState(background=ingestion), 5.0).background is ingestion


def test_idle_work_runs_only_when_nothing_else_does():
    assert plan_round(LoopState(scheduler_idle_work=True), 5.0).scheduler
    assert not plan_round(LoopState(queued_background=object(), scheduler_idle_work=True), 5.0).scheduler
    assert not plan_round(LoopState(background=object(), scheduler_idle_work=True), 5.0).scheduler
    assert not plan_round(LoopState(active=(object(),), scheduler_idle_work=True), 5.0).scheduler


def test_requests_keep_decoding_while_a_background_task_runs():
    """An ingestion's steps and the requests' decode steps take turns in the one loop."""
    trace: list[str] = []

    async def scenario():
        scheduler = _scheduler(FakeModel(trace))
        worker = ModelWorker(scheduler, background_wait_s=0.0)
        worker.start()
        started = asyncio.Event()
        loop = asyncio.get_running_loop()

        def ingestion(task):
            for _ in range(400):
                trace.append("ingest")
                loop.call_soon_threadsafe(started.set)
                time.sleep(0.002)
                yield
            return "ingested"

        background = worker.submit(Task("ingest", ingestion, interactive=False))
        await started.wait()
        stream = worker.submit_requests(RequestStream("test", [_request(max_new_tokens=12)]))
        (completion,) = await stream.wait()
        assert completion.token_ids == list(range(12)) and not background.done
        assert await background.wait() == "ingested"
        worker.stop()

    asyncio.run(scenario())
    decodes = [index for index, step in enumerate(trace) if step == "decode"]
    between = trace[decodes[0] : decodes[-1]]
    assert len(decodes) == 11 and between.count("ingest") >= 10  # one ingestion step between two decodes


def test_a_cancelled_background_task_sees_the_cancellation_where_it_stopped():
    seen: list[str] = []

    async def scenario():
        worker = ModelWorker()
        worker.start()

        def body(task):
            try:
                while True:
                    time.sleep(0.001)
                    yield
            except RequestCancelled:
                seen.append("cancelled")  # what a job record's wrapper catches
                raise

        task = worker.submit(Task("ingest", body, interactive=False))
        async for _ in task.items():
            task.cancel()
            break
        with pytest.raises(RequestCancelled):
            await task.wait()
        worker.stop()
        assert task.outcome == "cancelled"

    asyncio.run(scenario())
    assert seen == ["cancelled"]
