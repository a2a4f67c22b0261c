"""The prefetch stage and the writes behind the model, against a stand-in model and
stand-in stores (no weights): a request's store reads run on the prefetch thread while the
running requests decode (counted in steps), a failed read fails its request alone, the
bytes read ahead stay under the bound, and writes queued behind are read back and reach
the store by close."""

from __future__ import annotations

import threading

import pytest
import torch
from scheduler_fakes import EOS, FakeCache, FakeModel, FakeTokenizer, logits

from ragkv.app.generate import CollectingSink
from ragkv.app.request import Fetched, Prepared, Request
from ragkv.app.scheduler import Scheduler, SchedulerConfig
from ragkv.app.server.prefetch import Prefetcher
from ragkv.app.usage import TokenUsage
from ragkv.engine import pacing
from ragkv.engine.generation import GenerationConfig
from ragkv.store.errors import StoreUnavailableError
from ragkv.store.keys import ChunkKey
from ragkv.store.write_behind import WriteBehindStore

WAIT_S = 60.0
"""How long a test waits for a thread's event at most (a hang guard, not a timing)."""


class SlowStore:
    """A stand-in store read: blocks until `go` is set (a slow Redis), then gives `nbytes`,
    or raises when `fail` (Redis down)."""

    def __init__(self, nbytes: int = 0, fail: bool = False, blocked: bool = False):
        self.nbytes, self.fail = nbytes, fail
        self.go = threading.Event()
        if not blocked:
            self.go.set()
        self.reads = 0

    def read(self) -> int:
        if not self.go.wait(WAIT_S):
            raise TimeoutError("the stand-in store was never released")
        self.reads += 1
        if self.fail:
            raise StoreUnavailableError("redis at 127.0.0.1:1 is down")
        return self.nbytes


def _request(store: SlowStore | None = None, max_new_tokens: int = 4, on_fetch=None) -> Request:
    """A request whose fetch reads `store` (None: no fetch); `on_fetch` is called as each
    fetch starts."""

    def fetch(request: Request) -> Fetched:
        if on_fetch is not None:
            on_fetch()
        return Fetched(store.read())

    def prepare(request: Request) -> Prepared:
        assert store is None or request.fetched is not None  # computed from what the fetch read
        return Prepared(FakeCache(8), logits(0), TokenUsage(prompt_tokens=8), "none")

    sink = CollectingSink()
    sink.cancelled = False
    generation = GenerationConfig(max_new_tokens=max_new_tokens)
    return Request("test", prepare, generation, sink, fetch=fetch if store is not None else None)


def _scheduler(prefetch: Prefetcher | None, **config) -> tuple[Scheduler, FakeModel]:
    model = FakeModel()
    return Scheduler(model, FakeTokenizer(), {EOS}, SchedulerConfig(**config), prefetch=prefetch), model


@pytest.fixture
def prefetch():
    prefetcher = Prefetcher(max_bytes=1 << 20)
    yield prefetcher
    prefetcher.close()


def test_a_slow_store_read_does_not_delay_the_running_decodes(prefetch):
    scheduler, _ = _scheduler(prefetch)
    running = _request(max_new_tokens=32)
    scheduler.add(running)
    scheduler.step()  # prepared: it decodes from now on
    slow_store = SlowStore(blocked=True)
    slow = _request(slow_store)
    scheduler.add(slow)
    tokens = len(running.output_ids)
    for _ in range(10):  # the read is blocked all along: had a step waited for it, none would end
        plan = scheduler.step()
        assert plan.prepare is None and plan.decode == (running,)
    assert len(running.output_ids) == tokens + 10 and not slow.ready and slow in scheduler.waiting
    slow_store.go.set()
    assert slow._fetch_done.wait(WAIT_S)
    plan = scheduler.step()
    assert plan.prepare is slow and plan.decode == (running, slow)
    scheduler.run_until_done()
    assert running.sink.completion is not None and slow.sink.completion is not None
    assert slow_store.reads == 1 and prefetch.held_bytes == 0


def test_a_preparation_in_pieces_keeps_the_worker_stepping(prefetch):
    """A preparation paused beside a decode that then ends is work to do: the worker, which
    sleeps while `has_ready_work` is false, must step it to its end (with nothing left to
    decode beside it, the rest runs in that one step)."""
    pieces = []

    def prepare(request: Request) -> Prepared:
        for _ in range(4):  # a long prefill: four pieces of the step's budget
            pieces.append(len(pieces))
            pacing.spent(64, 0.0)
        return Prepared(FakeCache(8), logits(0), TokenUsage(prompt_tokens=256), "none")

    short = _request(max_new_tokens=2)
    sink = CollectingSink()
    sink.cancelled = False
    request = Request("test", prepare, GenerationConfig(max_new_tokens=2), sink)
    scheduler, _ = _scheduler(prefetch, max_num_batched_tokens=64)
    scheduler.add(short, request)
    steps = 0
    while scheduler.has_ready_work and steps < 20:
        scheduler.step()
        steps += 1
        if short.sink.completion is not None and request not in scheduler.running and sink.completion is None:
            assert scheduler.preparing is not None  # paused, with nothing decoding
    assert short.sink.completion is not None and sink.completion is not None
    assert len(pieces) == 4 and scheduler.prefill_pieces == 1  # one pause beside the decode, then whole


def test_without_a_prefetch_stage_the_fetch_runs_in_the_prepare():
    scheduler, _ = _scheduler(None)
    store = SlowStore(nbytes=10)
    request = _request(store)
    assert not request.ready
    scheduler.add(request)
    assert scheduler.step().prepare is request and store.reads == 1
    scheduler.run_until_done()
    assert request.sink.completion.token_ids == [0, 1, 2, 3]


def test_a_failed_store_read_fails_its_request_only(prefetch):
    scheduler, _ = _scheduler(prefetch)
    fine = [_request(SlowStore(nbytes=100)) for _ in range(2)]
    broken = _request(SlowStore(fail=True))
    scheduler.add(fine[0], broken, fine[1])
    for request in (*fine, broken):
        assert request._fetch_done.wait(WAIT_S)
    scheduler.run_until_done()
    assert isinstance(broken.sink.error, StoreUnavailableError) and "is down" in str(broken.sink.error)
    assert broken.sink.completion is None and broken.cache is None
    for request in fine:
        assert request.sink.error is None and request.sink.completion.token_ids == [0, 1, 2, 3]
    assert prefetch.held_bytes == 0


def test_the_bytes_read_ahead_stay_under_the_bound():
    prefetcher = Prefetcher(max_bytes=250)
    try:
        scheduler, _ = _scheduler(prefetcher, max_running=1)
        held: list[int] = []
        record = lambda: held.append(prefetcher.held_bytes)  # noqa: E731
        requests = [_request(SlowStore(nbytes=100), max_new_tokens=2, on_fetch=record) for _ in range(6)]
        scheduler.add(*requests)
        for request in requests[:3]:  # 0, 100, 200 held when each starts: all under 250
            assert request._fetch_done.wait(WAIT_S)
        while scheduler.has_work:
            scheduler.step()
            assert prefetcher.held_bytes <= 300  # the bound plus one fetch
        assert all(r.sink.completion is not None for r in requests)
        assert len(held) == 6 and max(held) < 250 and prefetcher.held_bytes == 0
    finally:
        prefetcher.close()


def test_a_cancelled_request_waiting_for_its_read_is_dropped_and_its_bytes_released(prefetch):
    scheduler, _ = _scheduler(prefetch)
    store = SlowStore(nbytes=100, blocked=True)
    request = _request(store)
    scheduler.add(request)
    request.sink.cancelled = True
    assert scheduler.has_ready_work  # a request gone is work: it is dropped
    plan = scheduler.step()
    assert plan.drop == (request,) and not scheduler.waiting
    store.go.set()
    prefetch.close()  # the read under way ends
    assert prefetch.held_bytes == 0


# -- writes behind ------------------------------------------------------------------------------


class GatedStore:
    """A stand-in chunk store whose writes wait for `go`."""

    def __init__(self):
        self.data: dict[ChunkKey, dict] = {}
        self.go = threading.Event()
        self.required: list[ChunkKey] = []

    def get_many(self, keys):
        return [self.data.get(key) for key in keys]

    def put_many(self, items, *, required: bool = False) -> int:
        if not self.go.wait(WAIT_S):
            raise TimeoutError("the stand-in store was never released")
        for key, tensors, _ in items:
            self.data[key] = dict(tensors)
            if required:
                self.required.append(key)
        return 1

    def stats(self) -> str:
        return "gated"


def _key(name: str) -> ChunkKey:
    return ChunkKey("fp", name, 1)


def test_writes_behind_are_read_back_at_once_and_reach_the_store_by_close():
    store = GatedStore()
    behind = WriteBehindStore(store)
    blobs = {f"c{i}": {"tokens": torch.arange(i + 1)} for i in range(4)}
    for name, blob in blobs.items():
        behind.put(_key(name), blob)  # the store's writes are blocked: these return at once
    assert not store.data and behind.queued_bytes > 0
    read = behind.get_many([_key("c2"), _key("absent")])
    assert torch.equal(read[0]["tokens"], blobs["c2"]["tokens"]) and read[1] is None
    assert behind.stats() == "gated"  # the rest is the store's
    store.go.set()
    behind.close()
    assert set(store.data) == {_key(name) for name in blobs} and behind.queued_bytes == 0
    behind.put(_key("late"), {"tokens": torch.arange(2)})  # after close: written now
    assert _key("late") in store.data


def test_a_required_write_goes_to_the_store_after_the_queued_ones():
    store = GatedStore()
    behind = WriteBehindStore(store)
    behind.put(_key("fill"), {"tokens": torch.arange(3)})
    store.go.set()
    behind.put(_key("ingested"), {"tokens": torch.arange(3)}, required=True)
    assert list(store.data) == [_key("fill"), _key("ingested")] and store.required == [_key("ingested")]
    behind.close()
