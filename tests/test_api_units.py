"""API building blocks without a model: sessions (memory and a real redis-server), API
keys, request conversion, the model worker's scheduling and cancellation."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis
import torch

from ragkv.api.auth import Authenticator, load_api_keys
from ragkv.api.config import ServeConfig
from ragkv.api.errors import ApiError, QueueFullError
from ragkv.api.jobs import SUCCEEDED, JobRegistry
from ragkv.api.schemas import ChatRequest, QueryRequest, generation_config, query_config
from ragkv.api.sessions import MemorySessions, RedisSessions, Session, SessionBusyError, decode_session, encode_session
from ragkv.api.worker import Job, JobCancelled, ModelWorker
from ragkv.engine.kv_cache import KVCache
from ragkv.store.errors import CorruptBlobError


def _session(session_id: str, rows: int = 8, tenant: str = "t1", turns: int = 1) -> Session:
    keys = torch.randn(2, 1, rows, 4)
    values = torch.randn(2, 1, rows, 4)
    session = Session(session_id, tenant, "fp", list(range(rows)), KVCache(keys, values, rows, rows),
                      last_answer="answer", chunk_hashes=["h1"], citations=[{"document_id": "d"}], turns=turns)
    session.version = f"v{turns}"
    return session


# -- sessions -----------------------------------------------------------------------------

def test_session_blob_round_trip_and_corruption():
    session = _session("s1", rows=5)
    blob = encode_session(session)
    loaded = decode_session(blob)
    assert loaded.token_ids == session.token_ids and loaded.last_answer == "answer" and loaded.turns == 1
    assert torch.equal(loaded.cache.keys, session.cache.keys[:, :, :5]) and loaded.cache.length == 5
    broken = bytearray(blob)
    broken[-3] ^= 0xFF
    with pytest.raises(CorruptBlobError):
        decode_session(broken)


def test_memory_sessions_bound_bytes_expire_and_refuse_concurrent_turns():
    one = _session("a").nbytes
    store = MemorySessions(capacity_bytes=2 * one, ttl_s=60)
    for name in ("a", "b", "c"):
        store.put(_session(name))
    assert store.stats()["sessions"] == 2 and store.stats()["evicted"] == 1
    assert store.checkout("t1", "a") is None  # least recently used went first
    store.release("t1", "a", None)
    session = store.checkout("t1", "b")
    assert session is not None
    with pytest.raises(SessionBusyError):
        store.checkout("t1", "b")
    store.release("t1", "b", session)
    assert store.checkout("t2", "b") is None  # another tenant's id is another session
    store.release("t2", "b", None)
    store.ttl_s = 0.05
    time.sleep(0.1)
    assert store.checkout("t1", "c") is None and store.stats()["expired"] >= 1


def test_redis_sessions_are_shared_locked_and_survive_redis_loss(killable_redis):
    replica_a = RedisSessions(killable_redis.url, MemorySessions(1 << 20, 60), ttl_s=60)
    replica_b = RedisSessions(killable_redis.url, MemorySessions(1 << 20, 60), ttl_s=60)
    assert replica_a.checkout("t1", "s") is None
    with pytest.raises(SessionBusyError):
        replica_b.checkout("t1", "s")  # the Redis lock spans replicas
    replica_a.release("t1", "s", _session("s", turns=1))
    seen = replica_b.checkout("t1", "s")
    assert seen is not None and seen.turns == 1 and seen.token_ids == list(range(8))
    seen.turns, seen.version = 2, "v2"
    replica_b.release("t1", "s", seen)
    again = replica_a.checkout("t1", "s")  # A's memory copy is stale: it reads B's turn
    assert again.turns == 2
    replica_a.release("t1", "s", again)
    assert replica_a.checkout("t2", "s") is None  # tenants never share
    replica_a.release("t2", "s", None)

    killable_redis.stop()
    started = time.perf_counter()
    session = replica_a.checkout("t1", "s")  # Redis gone: the memory copy answers
    assert session is not None and session.turns == 2
    session.turns = 3
    replica_a.release("t1", "s", session)
    assert replica_a.healthy() is False and replica_a.stats()["redis_up"] is False
    assert replica_a.checkout("t1", "s").turns == 3
    replica_a.release("t1", "s", None)
    assert time.perf_counter() - started < 5
    replica_a.close()
    replica_b.close()


def test_redis_session_keys_expire(redis_url):
    sessions = RedisSessions(redis_url, MemorySessions(1 << 20, 60), ttl_s=30)
    sessions.checkout("t1", "ttl")
    sessions.release("t1", "ttl", _session("ttl"))
    client = redis.Redis.from_url(redis_url)
    for part in ("kv", "meta"):
        assert 0 < client.pttl(f"ragkv:session:t1:ttl:{part}") <= 30_000
    assert client.get("ragkv:session:t1:ttl:lock") is None
    assert sessions.delete("t1", "ttl")
    sessions.close()


# -- API keys and tenants ---------------------------------------------------------------------

def test_api_keys_from_file_and_env(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"alpha-key-0001": "alpha"}))
    keys = load_api_keys(path, env="beta-key-00002:beta")
    assert keys == {"alpha-key-0001": "alpha", "beta-key-00002": "beta"}
    auth = Authenticator(keys)
    assert auth.tenant_for("Bearer alpha-key-0001") == "alpha"
    assert auth.tenant_for("bearer beta-key-00002") == "beta"
    for header, code in ((None, "missing_api_key"), ("Bearer nope-nope-nope", "invalid_api_key"), ("Basic xyz", "bad_authorization")):
        with pytest.raises(ApiError) as error:
            auth.tenant_for(header)
        assert error.value.status == 401 and error.value.code == code
    assert Authenticator({}).tenant_for(None) == "default"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        load_api_keys(path, env="")
    with pytest.raises(ValueError, match="tenant must be"):
        load_api_keys(None, env="some-long-key:bad/tenant")


# -- request conversion -------------------------------------------------------------------------

def test_requests_convert_to_typed_configs_or_400():
    limits = ServeConfig(max_new_tokens=64, max_top_k=8)
    request = QueryRequest(question="q", top_k=3, strategy="cacheblend", ratio=0.3, max_tokens=8, stop=["\n\n"])
    generation = generation_config(request.max_tokens, request.temperature, request.top_p, request.seed, request.stop, limits)
    config = query_config(request, generation, limits)
    assert config.top_k == 3 and config.fusion.strategy == "cacheblend" and config.fusion.ratio == 0.3
    assert config.generation.max_new_tokens == 8 and config.generation.stop == ("\n\n",)
    for kwargs, fragment in (({"strategy": "nope"}, "unknown fusion strategy"), ({"ratio": 1.5}, "ratio"),
                             ({"top_k": 9}, "at most 8")):
        with pytest.raises(ApiError) as error:
            query_config(QueryRequest(question="q", **kwargs), generation, limits)
        assert error.value.status == 400 and fragment in error.value.message
    with pytest.raises(ApiError, match="at most 64"):
        generation_config(65, None, None, None, None, limits)
    with pytest.raises(ApiError, match="temperature"):
        generation_config(8, -1.0, None, None, None, limits)
    with pytest.raises(ValueError):
        QueryRequest(question="q", selector="nonsense")
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], n=2)
    assert chat.messages[0].text() == "hi"
    with pytest.raises(ApiError, match="n must be 1"):
        chat.refuse_unsupported()


def test_job_registry_is_per_tenant():
    jobs = JobRegistry()
    record = jobs.create("alpha", "ingest", "doc.txt")
    jobs.progress(record, 1, 4)
    assert jobs.get("alpha", record.id).to_dict()["progress"] == {"chunks_done": 1, "chunks_total": 4, "fraction": 0.25}
    assert jobs.get("beta", record.id) is None
    jobs.finish(record, SUCCEEDED, result={"ok": True})
    assert jobs.get("alpha", record.id).to_dict()["status"] == SUCCEEDED


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

        a = worker.submit(Job("q", counting("a", 3)))
        b = worker.submit(Job("q", counting("b", 3)))
        assert await a.wait() == "a" and await b.wait() == "b"
        assert trace.index("b0") < trace.index("a2")  # interleaved token by token

        slow = worker.submit(Job("q", counting("slow", 1000, delay=0.002)))
        seen = 0
        async for _ in slow.items():
            seen += 1
            if seen == 5:
                slow.cancel()
                break
        with pytest.raises(JobCancelled):
            await slow.wait()
        assert "slow" in closed and sum(t.startswith("slow") for t in trace) < 100

        def failing(job):
            raise ValueError("bad input")
            yield

        with pytest.raises(ValueError, match="bad input"):
            await worker.submit(Job("q", failing)).wait()

        blocker = worker.submit(Job("bg", counting("bg", 1, delay=0.5), interactive=False))
        await asyncio.sleep(0.1)
        for _ in range(3):
            worker.submit(Job("q", counting("x", 1)))
        with pytest.raises(QueueFullError):
            worker.submit(Job("q", counting("y", 1)))
        await blocker.wait()
        worker.stop()
        assert not worker.alive

    asyncio.run(scenario())


# -- replicas sharing one data folder -----------------------------------------------------------

def test_registry_of_another_replica_sees_new_documents(tmp_path):
    import numpy as np

    from ragkv.ingest.registry import ChunkRecord, DocumentRecord, Registry
    from ragkv.ingest.registry_lmdb import LMDBRegistry
    from ragkv.store.lmdb_env import LMDBEnvironment

    env = LMDBEnvironment(tmp_path / "db")
    replica_a, replica_b = LMDBRegistry(env), LMDBRegistry(env)  # separate caches, as in two processes

    def add(registry: Registry, doc_id: str, vector: list[float]) -> None:
        record = DocumentRecord(doc_id, "t", doc_id, doc_id + "-hash", 4, 512, "fp", time.time(),
                                [ChunkRecord(0, doc_id + "-chunk", 0, 4, 0, 4)])
        registry.add(record, "text", np.asarray([vector], dtype=np.float32))

    add(replica_a, "doc_1", [1.0, 0.0])
    assert [hit.doc_id for hit in replica_b.search("t", np.asarray([0.0, 1.0]), 5)] == ["doc_1"]  # B caches now
    add(replica_a, "doc_2", [0.0, 1.0])
    assert replica_b.search("t", np.asarray([0.0, 1.0]), 1)[0].doc_id == "doc_2"
    replica_a.remove("t", "doc_2")
    assert [hit.doc_id for hit in replica_b.search("t", np.asarray([0.0, 1.0]), 5)] == ["doc_1"]
    env.close()
