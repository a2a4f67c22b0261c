"""Cached chat contexts without a model: prefix matching by chained block hashes, tenant
isolation, the separate budgets of sessions and anonymous contexts, session blobs, and the
Redis session store (a real redis-server): shared by replicas, locked per turn, a lock
left by a killed process expires, DELETE frees it, Redis loss falls back to memory."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import redis
import torch

from ragkv.app.chat.context_blob import decode_context, encode_context
from ragkv.app.chat.contexts import (
    BLOCK_TOKENS,
    Context,
    ContextCache,
    Insertion,
    SessionBusyError,
    SessionNotFoundError,
    SessionStoreUnavailableError,
    block_hashes,
)
from ragkv.app.chat.session_store import RedisSessions
from ragkv.app.chat.shared_contexts import SharedContextConfig
from ragkv.engine.kv_cache import KVCache
from ragkv.store.errors import CorruptBlobError


def _context(
    context_id: str, ids: list[int], tenant: str = "t1", explicit: bool = False, turns: int = 1, fingerprint: str = "fp"
) -> Context:
    rows = len(ids)
    cache = KVCache(torch.randn(2, 1, rows, 4), torch.randn(2, 1, rows, 4), rows, rows)
    return Context(context_id, tenant, fingerprint, list(ids), list(ids), cache, explicit=explicit, turns=turns)


def _ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# -- prefix matching -------------------------------------------------------------------------


def test_match_picks_the_longest_cached_prefix():
    cache = ContextCache(1 << 30, 1 << 30, 600)
    history = _ids(100)
    cache.put(_context("short", history[:40]))
    cache.put(_context("long", history[:90]))
    cache.put(_context("other", _ids(90, start=1000)))
    cache.put(_context("diverges", history[:70] + [9999] * 30))

    match = cache.match("t1", "fp", history + [5, 6, 7])
    assert match.context.id == "long" and match.conversation_tokens == 90
    # Divergence inside a block: the exact common prefix, not only whole blocks.
    match = cache.match("t1", "fp", history[:75] + [1] * 20)
    assert match.context.id == "long" and match.conversation_tokens == 75
    assert cache.match("t1", "fp", _ids(BLOCK_TOKENS - 1)) is None  # shorter than a block: nothing to find
    assert cache.match("t1", "other-model", history) is None


def test_match_never_crosses_tenants():
    cache = ContextCache(1 << 30, 1 << 30, 600)
    cache.put(_context("mine", _ids(64), tenant="alpha"))
    assert cache.match("beta", "fp", _ids(64)) is None
    assert cache.match("alpha", "fp", _ids(64)).context.id == "mine"
    assert block_hashes("alpha", "fp", _ids(64)) != block_hashes("beta", "fp", _ids(64))
    with pytest.raises(SessionNotFoundError):
        cache.checkout("beta", "mine")


def test_anonymous_contexts_never_evict_sessions():
    one = _context("x", _ids(32)).nbytes
    cache = ContextCache(session_bytes=2 * one, anonymous_bytes=2 * one, ttl_s=600)
    cache.put(_context("s1", _ids(32), explicit=True))
    cache.put(_context("s2", _ids(32, 100), explicit=True))
    for n in range(20):
        cache.put(_context(f"anon{n}", _ids(32, 1000 * (n + 1))))
    stats = cache.stats()
    assert stats["sessions"] == 2 and stats["evicted"] == 0
    assert stats["anonymous"] == 2 and stats["anonymous_evicted"] == 18
    assert cache.checkout("t1", "s1").id == "s1"


def test_checkout_is_exclusive_unknown_is_not_found_and_delete_during_a_turn_wins():
    cache = ContextCache(1 << 30, 1 << 30, 600)
    cache.put(_context("s", _ids(32), explicit=True))
    with pytest.raises(SessionNotFoundError):
        cache.checkout("t1", "nope")
    held = cache.checkout("t1", "s")
    assert cache.match("t1", "fp", _ids(32)) is None  # out for a turn: not matched meanwhile
    with pytest.raises(SessionBusyError):
        cache.checkout("t1", "s")
    assert cache.delete("t1", "s")
    assert cache.release("t1", "s", held) is False  # deleted during the turn: not kept
    with pytest.raises(SessionNotFoundError):
        cache.checkout("t1", "s")


def test_a_taken_anonymous_context_is_gone_until_put_back():
    cache = ContextCache(1 << 30, 1 << 30, 600)
    context = _context("a", _ids(48))
    cache.put(context)
    assert cache.take(context) and not cache.take(context)
    assert cache.match("t1", "fp", _ids(48)) is None
    cache.release("t1", "a", None)
    assert cache.stats()["anonymous"] == 0


def test_rows_follow_the_spliced_documents():
    context = _context("d", _ids(10))
    context.row_ids = _ids(4) + [7] * 6 + _ids(6, 4)
    context.insertions = [Insertion(4, 6, ("h",))]
    assert context.rows_for(4) == 4 and context.rows_for(5) == 11 and context.chunks_before(4) == set()
    assert context.chunks_before(5) == {"h"}


def test_context_blob_round_trip_and_corruption():
    context = _context("s1", _ids(5), explicit=True)
    context.insertions = [Insertion(2, 0, ("h1", "h2"))]
    blob = encode_context(context)
    loaded = decode_context(blob)
    assert loaded.conversation_ids == context.conversation_ids and loaded.insertions == context.insertions
    assert torch.equal(loaded.cache.keys, context.cache.keys[:, :, :5]) and loaded.explicit
    broken = bytearray(blob)
    broken[-3] ^= 0xFF
    with pytest.raises(CorruptBlobError):
        decode_context(broken)


def test_a_context_travels_in_8_bits_at_about_half_the_bytes():
    rows = 300
    keys, values = torch.randn(4, 2, rows, 64, dtype=torch.bfloat16), torch.randn(4, 2, rows, 64, dtype=torch.bfloat16)
    context = Context("c8", "t1", "fp", _ids(rows), _ids(rows), KVCache(keys, values, rows, rows))
    sixteen, eight = encode_context(context), encode_context(context, kv_codes="int8")
    assert len(eight) < 0.6 * len(sixteen)
    loaded = decode_context(eight)
    assert loaded.cache.dtype == torch.bfloat16 and loaded.cache.length == rows
    for back, sent in ((loaded.cache.keys, keys), (loaded.cache.values, values)):
        step = (sent.float().amax() - sent.float().amin()) / 255  # one code step of the widest group
        assert (back.float() - sent.float()).abs().max() <= step
    with pytest.raises(ValueError):
        encode_context(context, kv_codes="int3")
    constant = Context("c0", "t1", "fp", _ids(rows), _ids(rows), KVCache(keys * 0 + 1, values * 0, rows, rows))
    flat = decode_context(encode_context(constant, kv_codes="int8")).cache
    assert torch.equal(flat.keys, constant.cache.keys) and torch.equal(flat.values, constant.cache.values)


# -- Redis sessions --------------------------------------------------------------------------


def _redis_sessions(url: str, lock_ttl_s: float = 10.0) -> RedisSessions:
    return RedisSessions(url, ContextCache(1 << 20, 1 << 20, 60), ttl_s=60, lock_ttl_s=lock_ttl_s)


def test_redis_sessions_are_shared_locked_and_survive_redis_loss(killable_redis):
    replica_a, replica_b = _redis_sessions(killable_redis.url), _redis_sessions(killable_redis.url)
    with pytest.raises(SessionNotFoundError):
        replica_a.checkout("t1", "s")
    replica_a.put(_context("s", _ids(8)))  # an anonymous context: memory only
    with pytest.raises(SessionNotFoundError):
        replica_b.checkout("t1", "s")
    held = replica_a.checkout("t1", "s")
    with pytest.raises(SessionBusyError):
        replica_b.checkout("t1", "s")  # the Redis lock spans replicas
    held.explicit = True  # a client named it: a session from now on, kept in Redis
    replica_a.release("t1", "s", held)
    seen = replica_b.checkout("t1", "s")
    assert seen.turns == 1 and seen.conversation_ids == _ids(8)
    seen.turns, seen.version = 2, "v2"
    replica_b.release("t1", "s", seen)
    again = replica_a.checkout("t1", "s")  # A's memory copy is stale: it reads B's turn
    assert again.turns == 2
    replica_a.release("t1", "s", again)
    with pytest.raises(SessionNotFoundError):
        replica_a.checkout("t2", "s")  # tenants never share

    killable_redis.stop()  # refused connections (nothing can hang): the memory copy answers
    context = replica_a.checkout("t1", "s")
    context.turns = 3
    replica_a.release("t1", "s", context)
    assert replica_a.healthy() is False and replica_a.stats()["redis_up"] is False
    assert replica_a.checkout("t1", "s").turns == 3
    replica_a.close()
    replica_b.close()


def test_a_session_kept_in_memory_during_an_outage_is_published_when_redis_returns(durable_redis):
    """While Redis is away: a replica without a copy answers retry-later (the session may exist),
    never not-found; a session named meanwhile says it is not shared, and the heartbeat
    publishes it when Redis answers again, so the other replica then continues it."""
    replica_a = _redis_sessions(durable_redis.url, lock_ttl_s=0.6)  # heartbeat every 0.2 s
    replica_b = _redis_sessions(durable_redis.url, lock_ttl_s=0.6)
    replica_b.put(_context("before", _ids(8)))
    named = replica_b.checkout("t1", "before")
    named.explicit = True
    replica_b.release("t1", "before", named)
    assert replica_b.shared(named)

    durable_redis.stop()
    with pytest.raises(SessionStoreUnavailableError):
        replica_a.checkout("t1", "before")  # in Redis, which cannot be asked: 503, not 404
    assert not replica_a.memory.is_busy("t1", "before")  # the refused checkout holds nothing
    replica_b.put(_context("during", _ids(8, 100)))
    held = replica_b.checkout("t1", "during")
    held.explicit = True
    replica_b.release("t1", "during", held)
    assert not replica_b.shared(held) and replica_b.stats()["unpublished"] == 1

    durable_redis.start()
    deadline = time.monotonic() + 120  # generous: the heartbeat's next beat on a loaded machine
    while replica_b.stats()["unpublished"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replica_b.shared(held)
    assert replica_a.healthy()  # ends A's back-off (a client's retry after Retry-After does the same)
    seen = replica_a.checkout("t1", "during")
    assert seen.conversation_ids == _ids(8, 100)
    replica_a.release("t1", "during", seen)
    assert replica_a.checkout("t1", "before").conversation_ids == _ids(8)  # kept by the append-only file
    replica_a.close()
    replica_b.close()


def test_a_late_publish_never_overwrites_a_newer_turn(durable_redis):
    replica_a, replica_b = _redis_sessions(durable_redis.url), _redis_sessions(durable_redis.url)
    replica_b.put(_context("s", _ids(8)))
    held = replica_b.checkout("t1", "s")
    held.explicit = True
    replica_b.release("t1", "s", held)
    durable_redis.stop()
    stale = replica_b.checkout("t1", "s")  # B's memory copy answers a turn while Redis is away
    stale.turns, stale.version = 2, "b2"
    replica_b.release("t1", "s", stale)
    durable_redis.start()
    assert replica_a.healthy()
    newer = replica_a.checkout("t1", "s")  # A continues from Redis' copy, twice, meanwhile
    newer.turns, newer.version = 3, "a3"
    replica_a.release("t1", "s", newer)
    replica_b._link.healthy()  # end B's back-off now rather than after it
    replica_b._publish_pending()
    assert replica_b.stats()["unpublished"] == 0
    assert replica_a.checkout("t1", "s").version == "a3"
    replica_a.close()
    replica_b.close()


def test_a_lock_whose_release_missed_redis_is_freed_when_redis_returns(durable_redis):
    client = redis.Redis.from_url(durable_redis.url)
    replica_a, replica_b = _redis_sessions(durable_redis.url), _redis_sessions(durable_redis.url, lock_ttl_s=60)
    replica_b.put(_context("s", _ids(8)))
    held = replica_b.checkout("t1", "s")  # the turn takes the Redis lock ...
    held.explicit = True
    durable_redis.stop()
    replica_b.release("t1", "s", held)  # ... and ends while Redis is away
    durable_redis.start()
    assert client.get("ragkv:session:t1:s:lock") is not None  # kept by the append-only file
    with pytest.raises(SessionBusyError):
        replica_a.checkout("t1", "s")
    replica_b._link.healthy()  # end B's back-off now
    replica_b._publish_pending()  # what B's heartbeat does once Redis answers
    assert client.get("ragkv:session:t1:s:lock") is None  # freed, not left for its 60 s TTL
    assert replica_a.checkout("t1", "s").conversation_ids == _ids(8)
    replica_a.close()
    replica_b.close()


def _published(sessions: RedisSessions, count: int) -> None:
    deadline = time.monotonic() + 120  # generous: the publisher thread on a loaded machine
    while sessions.shared_contexts.stats.published < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sessions.shared_contexts.stats.published == count


def _sharing(url: str, budget: int = 1 << 20, mac_key: bytes | None = None, codes: str = "16bit") -> RedisSessions:
    memory = ContextCache(1 << 20, 1 << 20, 60)
    shared = SharedContextConfig(budget, 60, min_rows=64, min_gain=16, kv_codes=codes)
    return RedisSessions(url, memory, ttl_s=60, shared=shared, mac_key=mac_key)


def test_an_anonymous_context_published_by_one_replica_is_continued_by_another(redis_url):
    """The follow-up a client resends whole lands on replica B: B finds A's context by the
    conversation's prefix in Redis and gets A's rows bit for bit (a 16-bit cache travels as is)."""
    redis.Redis.from_url(redis_url).flushdb()
    replica_a, replica_b = _sharing(redis_url), _sharing(redis_url)
    other_secret = _sharing(redis_url, mac_key=b"k" * 32)
    try:
        context = _context("ctx1", _ids(100))
        context.cache = KVCache(
            context.cache.keys.to(torch.bfloat16), context.cache.values.to(torch.bfloat16), 100, 100
        )
        replica_a.put(context)
        _published(replica_a, 1)
        follow_up = _ids(100) + [7, 7, 7]
        assert replica_b.memory.match("t1", "fp", follow_up) is None  # not in B's own memory
        found = replica_b.match("t1", "fp", follow_up)
        assert found is not None and found.conversation_tokens == 100 and found.context.id == "ctx1"
        assert torch.equal(found.context.cache.keys, context.cache.keys[:, :, :100])
        assert torch.equal(found.context.cache.values, context.cache.values[:, :, :100])
        assert found.context.row_ids == context.row_ids and not found.context.explicit
        assert replica_b.match("t2", "fp", follow_up) is None  # tenants never share
        assert replica_b.match("t1", "other model", follow_up) is None  # nor models
        assert other_secret.match("t1", "fp", follow_up) is None  # a blob failing its MAC is not used
        local = replica_a.match("t1", "fp", follow_up)  # A's own copy covers all but 3 tokens: no fetch
        assert local.context is context and replica_a.shared_contexts.stats.lookups == 0
        replica_b.put(_context("ctx2", _ids(130)))  # B's longer turn, published
        _published(replica_b, 1)
        assert replica_a.match("t1", "fp", _ids(130) + [7]).context.id == "ctx2"  # 30 more tokens: fetched
        short = _context("short", _ids(100))
        short.cache.truncate(20)
        short.conversation_ids, short.row_ids = _ids(20, start=5000), _ids(20, start=5000)
        replica_a.put(short)  # under min_rows: published by id only; by prefix, recomputing costs less than a fetch
        assert replica_a.publication("t1", "short").result(timeout=10) is True
        assert replica_b.match("t1", "fp", _ids(20, start=5000) + [7]) is None
    finally:
        for sessions in (replica_a, replica_b, other_secret):
            sessions.close()


def test_the_id_an_anonymous_answer_named_continues_on_another_replica(redis_url):
    """A client names the id turn 1's answer gave (anonymous, on A) and sends only its new
    message to B: B reads A's published context by that id and continues it as a session,
    which A then finds in Redis too. The publish is a future the API waits for (bounded)
    before the answer's last event."""
    redis.Redis.from_url(redis_url).flushdb()
    replica_a, replica_b = _sharing(redis_url), _sharing(redis_url)
    try:
        context = _context("anon1", _ids(30))  # under min_rows: published by id, not by prefix
        replica_a.put(context)
        published = replica_a.publication("t1", "anon1")
        assert published.result(timeout=10) is True and replica_a.publication("t1", "anon1") is None
        assert replica_a.shared_contexts.stats.publish_seconds > 0
        with pytest.raises(SessionNotFoundError):
            replica_b.checkout("t1", "never-named")
        with pytest.raises(SessionNotFoundError):
            replica_b.checkout("t2", "anon1")  # another tenant's id is unknown
        continued = replica_b.checkout("t1", "anon1")
        assert continued.conversation_ids == context.conversation_ids and not continued.explicit
        assert torch.equal(continued.cache.keys, context.cache.keys.to(torch.float16).float()[:, :, :30])
        assert replica_b.shared_contexts.stats.loaded == 1
        turn_two = _context("anon1", _ids(40), explicit=True, turns=2)
        replica_b.release("t1", "anon1", turn_two)  # now a session in Redis
        assert replica_b.shared(turn_two)
        back_on_a = replica_a.checkout("t1", "anon1")  # A's own anonymous copy is older than Redis's session
        assert back_on_a.turns == 2 and back_on_a.conversation_ids == _ids(40)
        replica_a.release("t1", "anon1", None)
    finally:
        replica_a.close()
        replica_b.close()


def test_a_context_published_in_8_bits_is_found_and_read_back_in_the_caches_dtype(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    replica_a, replica_b = _sharing(redis_url, codes="int8"), _sharing(redis_url)
    try:
        context = _context("c8", _ids(100))
        replica_a.put(context)
        assert replica_a.publication("t1", "c8").result(timeout=10) is True
        found = replica_b.match("t1", "fp", _ids(100) + [7, 7, 7])
        assert found is not None and found.conversation_tokens == 100
        back, sent = found.context.cache.keys, context.cache.keys[:, :, :100]
        assert back.dtype == sent.dtype == torch.float32
        assert (back - sent).abs().max() <= (sent.amax() - sent.amin()) / 255
        kv = redis.Redis.from_url(redis_url).get("ragkv:context:{t1}:kv:c8")
        assert kv is not None and b"keys.codes" in kv
    finally:
        replica_a.close()
        replica_b.close()


def test_each_tenant_keeps_its_shared_contexts_within_its_budget(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    one = len(encode_context(_context("probe", _ids(100))))  # float32 in the test, float16 in Redis: a bound
    replica_a, replica_b = _sharing(redis_url, budget=int(one * 1.2)), _sharing(redis_url)
    try:
        for n in range(3):
            replica_a.put(_context(f"c{n}", _ids(100, start=1000 * n)))
            _published(replica_a, n + 1)
        replica_a.put(_context("other tenant", _ids(100), tenant="t2"))
        _published(replica_a, 4)
        assert replica_a.shared_contexts.stats.evicted == 1  # 2 of t1's 3 fit at float16; t2 has its own budget
        assert replica_b.match("t1", "fp", _ids(100) + [1]) is None  # the oldest was dropped
        for n in (1, 2):
            assert replica_b.match("t1", "fp", _ids(100, start=1000 * n) + [1]).context.id == f"c{n}"
        assert replica_b.match("t2", "fp", _ids(100) + [1]).context.id == "other tenant"
    finally:
        replica_a.close()
        replica_b.close()


def test_redis_keeps_sessions_only_with_ttls(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()  # another test's sessions of the same names may be there
    sessions = _redis_sessions(redis_url)
    for n in range(5):
        sessions.put(_context(f"anon{n}", _ids(8)))
    assert not client.keys("ragkv:session:t1:anon*")  # anonymous contexts never reach Redis
    sessions.put(_context("ttl", _ids(8)))
    context = sessions.checkout("t1", "ttl")
    context.explicit = True
    sessions.release("t1", "ttl", context)
    for part in ("kv", "meta"):
        assert 0 < client.pttl(f"ragkv:session:t1:ttl:{part}") <= 60_000
    assert client.get("ragkv:session:t1:ttl:lock") is None
    assert sessions.delete("t1", "ttl") and not client.keys("ragkv:session:t1:ttl:*")
    sessions.close()


KILLED_LOCK_TTL_S = 2.0
KILLED_LOCK = "ragkv:session:t1:killed:lock"


def _expiry_ms(client: redis.Redis, key: str) -> int:
    """When the key expires, in Redis' clock (-2: it is gone)."""
    return int(client.execute_command("PEXPIRETIME", key))


def _wait_for_a_renewal(client: redis.Redis, key: str) -> None:
    """Polls until the key's expiry moves later (renewed), failing if it expires first."""
    first = _expiry_ms(client, key)
    assert first > 0, "the lock is not held"
    deadline = time.monotonic() + 120  # generous: the holder's heartbeat on a loaded machine
    while time.monotonic() < deadline:
        now = _expiry_ms(client, key)
        assert now != -2, "the lock expired: the live holder's heartbeat did not renew it"
        if now > first:
            return
        time.sleep(0.05)
    raise AssertionError("the lock was never renewed")


def _hold_lock_and_die(url: str, ready) -> None:
    sessions = RedisSessions(url, ContextCache(1 << 20, 1 << 20, 60), ttl_s=60, lock_ttl_s=KILLED_LOCK_TTL_S)
    context = _context("killed", _ids(8), explicit=True)
    sessions.put(context)
    held = sessions.checkout("t1", "killed")
    held.explicit = True
    sessions.release("t1", "killed", held)  # saved to Redis
    sessions.checkout("t1", "killed")  # a turn starts ...
    ready.set()
    time.sleep(60)  # ... and the process is killed in the middle of it


def test_a_lock_left_by_a_killed_process_expires_and_delete_frees_it(redis_url):
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=_hold_lock_and_die, args=(redis_url, ready))
    process.start()
    assert ready.wait(60)
    client = redis.Redis.from_url(redis_url)
    sessions = _redis_sessions(redis_url)
    try:
        _wait_for_a_renewal(client, KILLED_LOCK)  # the live process's heartbeat keeps it past its TTL
        with pytest.raises(SessionBusyError):
            sessions.checkout("t1", "killed")
        process.kill()
        process.join()
        # polled until it is gone: it expires after the lock TTL, far sooner than the 120 s below
        deadline = time.monotonic() + 60
        while client.get(KILLED_LOCK) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.get(KILLED_LOCK) is None
        resumed = sessions.checkout("t1", "killed")
        assert resumed.conversation_ids == _ids(8)
        sessions.release("t1", "killed", resumed)

        client.set(KILLED_LOCK, "a dead process", px=120_000)
        with pytest.raises(SessionBusyError):
            sessions.checkout("t1", "killed")
        assert sessions.delete("t1", "killed")  # DELETE /v1/sessions/ID frees the lock with the session
        assert client.get(KILLED_LOCK) is None
        with pytest.raises(SessionNotFoundError):
            sessions.checkout("t1", "killed")
    finally:
        if process.is_alive():
            process.kill()
        sessions.close()
