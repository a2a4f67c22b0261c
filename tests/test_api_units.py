"""API building blocks without a model: API keys, request conversion, the model worker's
scheduling and cancellation (sessions: tests/test_contexts.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

from ragkv.api.auth import Authenticator, load_api_keys, load_key_limits
from ragkv.api.chat.protocol import ChatRequest
from ragkv.api.common.conversion import generation_config, query_config
from ragkv.api.config import ServeConfig
from ragkv.api.documents.protocol import JobProgress
from ragkv.api.documents.serving import job_status
from ragkv.api.errors import ApiError, QueueFullError, as_api_error
from ragkv.api.query.protocol import QueryRequest
from ragkv.api.rate_limits import KeyLimits
from ragkv.app.ingest_records import SUCCEEDED, IngestRecords
from ragkv.app.request import Request, RequestCancelled
from ragkv.app.scheduler import QueueFull, Scheduler, SchedulerConfig
from ragkv.app.server.request_stream import RequestStream
from ragkv.app.server.task import Task
from ragkv.app.server.worker import ModelWorker
from ragkv.engine.generation import GenerationConfig
from ragkv.store.lmdb_env import LMDBEnvironment

# -- API keys and tenants ---------------------------------------------------------------------


def test_api_keys_from_file_and_env(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"alpha-key-0001": "alpha"}))
    keys = load_api_keys(path, env="beta-key-00002:beta")
    assert keys == {"alpha-key-0001": "alpha", "beta-key-00002": "beta"}
    auth = Authenticator(keys)
    assert auth.tenant_for("Bearer alpha-key-0001") == "alpha"
    assert auth.tenant_for("bearer beta-key-00002") == "beta"
    for header, code in (
        (None, "missing_api_key"),
        ("Bearer nope-nope-nope", "invalid_api_key"),
        ("Basic xyz", "bad_authorization"),
    ):
        with pytest.raises(ApiError) as error:
            auth.tenant_for(header)
        assert error.value.status == 401 and error.value.code == code
    assert Authenticator({}).tenant_for(None) == "default"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        load_api_keys(path, env="")
    with pytest.raises(ValueError, match="tenant must be"):
        load_api_keys(None, env="some-long-key:bad/tenant")


def test_keys_file_entries_set_their_own_limits_over_the_servers(tmp_path):
    path = tmp_path / "keys.json"
    entries = {
        "plain-key-0001": "alpha",
        "capped-key-0001": {"tenant": "beta", "max_requests_per_second": 2},
        "unlimited-key-01": {"tenant": "beta", "max_concurrent_requests": 0},
    }
    path.write_text(json.dumps(entries))
    server = KeyLimits(max_requests_per_second=10, max_concurrent_requests=4)
    assert load_api_keys(path, env="") == {
        "plain-key-0001": "alpha",
        "capped-key-0001": "beta",
        "unlimited-key-01": "beta",
    }
    limits = load_key_limits(path, server)
    assert limits == {"capped-key-0001": KeyLimits(2, 4), "unlimited-key-01": KeyLimits(10, 0)}
    auth = Authenticator(load_api_keys(path, env=""), limits, server)
    plain, capped = auth.caller_for("Bearer plain-key-0001"), auth.caller_for("Bearer capped-key-0001")
    assert (plain.tenant, plain.limits) == ("alpha", server)
    assert (capped.tenant, capped.limits) == ("beta", KeyLimits(2, 4))
    assert plain.key_id != capped.key_id and "key" not in plain.key_id  # an id of the key, never the key
    for bad, message in (
        ({"tenant": "beta", "max_requests_per_second": -1}, "must be a number >= 0"),
        ({"tenant": "beta", "max_concurrent_requests": 1.5}, "must be an integer >= 0"),
        ({"tenant": "beta", "requests_per_minute": 5}, "unknown field"),
        ({"max_concurrent_requests": 1}, "must be a JSON object mapping"),
    ):
        path.write_text(json.dumps({"some-key-00001": bad}))
        with pytest.raises(ValueError, match=message):
            load_key_limits(path, server)


# -- request conversion -------------------------------------------------------------------------


def test_requests_convert_to_typed_configs_or_400():
    limits = ServeConfig(max_new_tokens=64, max_top_k=8)
    request = QueryRequest(question="q", top_k=3, strategy="cacheblend", ratio=0.3, max_tokens=8, stop=["\n\n"])
    generation = generation_config(
        request.max_tokens, request.temperature, request.top_p, request.seed, request.stop, limits
    )
    config = query_config(request, generation, limits)
    assert config.top_k == 3 and config.fusion.strategy == "cacheblend" and config.fusion.ratio == 0.3
    assert config.generation.max_new_tokens == 8 and config.generation.stop == ("\n\n",)
    sparse = query_config(QueryRequest(question="q", selector="a2ats:rerank=0"), generation, limits).sparse
    assert sparse.name == "a2ats" and sparse.options.rerank == 0 and sparse.aggregation == "logits"
    probs = query_config(QueryRequest(question="q", selector="pqcache"), generation, limits).sparse
    assert probs.aggregation == "probs"
    logits = query_config(QueryRequest(question="q", head_aggregation="logits"), generation, limits).sparse
    assert logits.name == "dense" and logits.head_aggregation == "logits"
    for kwargs, fragment in (
        ({"strategy": "a3:nope=1"}, "nope"),
        ({"top_k": 9}, "at most 8"),
        ({"selector": "a2ats:rerank=0.5"}, "rerank"),
    ):
        with pytest.raises(ApiError) as error:
            query_config(QueryRequest(question="q", **kwargs), generation, limits)
        assert error.value.status == 400 and fragment in error.value.message
    with pytest.raises(ApiError, match="at most 64"):
        generation_config(65, None, None, None, None, limits)
    with pytest.raises(ApiError, match="temperature"):
        generation_config(8, -1.0, None, None, None, limits)
    for kwargs in (
        {"selector": "nonsense"},
        {"selector": "a2ats:"},
        {"head_aggregation": "max"},
        {"strategy": "nope"},
        {"ratio": 1.5},
        {"question": " \n"},
        {"seed": 2**64},
    ):
        with pytest.raises(ValueError):
            QueryRequest(**{"question": "q", **kwargs})
    with pytest.raises(ValueError, match="surrogate"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "hi \udc80"}])
    with pytest.raises(ValueError):
        ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], tools=[{}])
    assert chat.messages[0].text() == "hi"
    with pytest.raises(ApiError, match="tools are not supported"):
        chat.refuse_unsupported()


def test_job_registry_is_per_tenant(tmp_path):
    jobs = IngestRecords(LMDBEnvironment(tmp_path / "db"))
    record = jobs.create("alpha", "ingest", "doc.txt")
    jobs.progress(record, 1, 4)
    assert job_status(jobs.get("alpha", record.id)).progress == JobProgress(
        chunks_done=1, chunks_total=4, fraction=0.25
    )
    assert jobs.get("beta", record.id) is None
    jobs.finish(record, SUCCEEDED)
    assert job_status(jobs.get("alpha", record.id)).status == SUCCEEDED


def test_a_job_whose_process_died_reads_as_failed(tmp_path):
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import os, sys; from ragkv.app.ingest_records import IngestRecords\n"
                "from ragkv.store.lmdb_env import LMDBEnvironment\n"
                "jobs = IngestRecords(LMDBEnvironment(sys.argv[1]))\n"
                "record = jobs.create('alpha', 'ingest', 'big.txt')\n"
                "jobs.start(record); jobs.progress(record, 3, 10)\n"
                "print(record.id, flush=True); os.kill(os.getpid(), 9)"
            ),
            str(tmp_path / "db"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    job_id = killed.stdout.strip()
    jobs = IngestRecords(LMDBEnvironment(tmp_path / "db"))
    shown = job_status(jobs.get("alpha", job_id))
    assert shown.status == "failed" and shown.error.code == "interrupted"
    assert shown.progress.chunks_done == 3 and jobs.get("beta", job_id) is None
    assert [record.id for record in jobs.list("alpha")] == [job_id]


# -- the model worker -----------------------------------------------------------------------------


def test_worker_interleaves_cancels_and_bounds_its_queue():
    async def scenario():
        worker = ModelWorker(max_active=2, max_queued=3)
        worker.start()
        trace: list[str] = []
        closed: list[str] = []

        def counting(name: str, steps: int, delay: float = 0.0):
            def body(job):
                try:
                    for index in range(steps):
                        time.sleep(delay)
                        trace.append(f"{name}{index}")
                        yield index
                    return name
                finally:
                    closed.append(name)

            return body

        a = worker.submit(Task("q", counting("a", 3)))
        b = worker.submit(Task("q", counting("b", 3)))
        assert await a.wait() == "a" and await b.wait() == "b"
        assert trace.index("b0") < trace.index("a2")  # interleaved token by token

        slow = worker.submit(Task("q", counting("slow", 1000, delay=0.002)))
        seen = 0
        async for _ in slow.items():
            seen += 1
            if seen == 5:
                slow.cancel()
                break
        with pytest.raises(RequestCancelled):
            await slow.wait()
        assert "slow" in closed and sum(t.startswith("slow") for t in trace) < 100

        def failing(job):
            raise ValueError("bad input")
            yield

        with pytest.raises(ValueError, match="bad input"):
            await worker.submit(Task("q", failing)).wait()

        blocker = worker.submit(Task("bg", counting("bg", 1, delay=0.5), interactive=False))
        await asyncio.sleep(0.1)
        for _ in range(3):
            worker.submit(Task("q", counting("x", 1)))
        with pytest.raises(QueueFull):
            worker.submit(Task("q", counting("y", 1)))
        await blocker.wait()
        worker.stop()
        assert not worker.alive

    asyncio.run(scenario())


def test_the_scheduler_alone_bounds_waiting_requests_and_a_stopping_worker_cancels_them():
    async def scenario():
        scheduler = Scheduler(None, None, set(), SchedulerConfig(max_waiting=2))
        worker = ModelWorker(scheduler, max_queued=100)  # the tasks' bound is not the requests'

        def never_prepared(request):
            raise AssertionError("a request of a stopping worker was prepared")

        def request():
            return Request("test", never_prepared, GenerationConfig(max_new_tokens=1))

        first = worker.submit_requests(RequestStream("test", [request(), request()]))
        with pytest.raises(QueueFull) as full:
            worker.submit_requests(RequestStream("test", [request()]))
        answer = as_api_error(full.value)  # what the API answers
        assert isinstance(answer, QueueFullError) and answer.status == 503 and answer.headers["Retry-After"]
        assert len(scheduler.waiting) == 2 and worker.queued == 2
        worker.stop()
        worker.start()
        with pytest.raises(RequestCancelled):
            await first.wait()
        await asyncio.to_thread(worker.stop)
        assert not worker.alive and not scheduler.has_work and first.outcome == "cancelled"

    asyncio.run(scenario())


# -- replicas sharing one data folder -----------------------------------------------------------


def test_worker_runs_its_jobs_on_the_thread_that_calls_run():
    """The server builds the engine on one thread and then runs the worker loop there, so
    every torch op of the process runs on one thread (one OpenMP pool)."""

    async def scenario():
        worker = ModelWorker()
        threads: list[str] = []

        def body(job):
            threads.append(threading.current_thread().name)
            yield 1
            return "done"

        model_thread = threading.Thread(target=worker.run, name="built-the-engine")
        model_thread.start()
        assert await worker.submit(Task("q", body)).wait() == "done"
        assert threads == ["built-the-engine"] and worker.alive
        await asyncio.to_thread(worker.stop)
        assert not model_thread.is_alive() and not worker.alive

    asyncio.run(scenario())


def test_registry_of_another_replica_sees_new_documents(tmp_path):
    import numpy as np

    from ragkv.ingest.registry import ChunkRecord, DocumentRecord, DocumentRegistry
    from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
    from ragkv.store.lmdb_env import LMDBEnvironment

    env = LMDBEnvironment(tmp_path / "db")
    replica_a, replica_b = LMDBDocumentRegistry(env), LMDBDocumentRegistry(env)  # separate caches, as in two processes

    def add(registry: DocumentRegistry, doc_id: str, vector: list[float]) -> None:
        record = DocumentRecord(
            doc_id,
            "t",
            doc_id,
            doc_id + "-hash",
            4,
            512,
            "fp",
            time.time(),
            [ChunkRecord(0, doc_id + "-chunk", 0, 4, 0, 4)],
        )
        registry.add(record, "text", np.asarray([vector], dtype=np.float32))

    add(replica_a, "doc_1", [1.0, 0.0])
    assert [hit.doc_id for hit in replica_b.search("t", np.asarray([0.0, 1.0]), 5)] == ["doc_1"]  # B caches now
    add(replica_a, "doc_2", [0.0, 1.0])
    assert replica_b.search("t", np.asarray([0.0, 1.0]), 1)[0].doc_id == "doc_2"
    replica_a.remove("t", "doc_2")
    assert [hit.doc_id for hit in replica_b.search("t", np.asarray([0.0, 1.0]), 5)] == ["doc_1"]
    env.close()


def test_finish_reasons_map_to_openai_values():
    from ragkv.api.common.serving import openai_finish_reason
    from ragkv.app.request import FinishReason

    mapped = {reason: openai_finish_reason(reason) for reason in FinishReason}
    assert mapped == {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
