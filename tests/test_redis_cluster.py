"""Redis Cluster (redis+cluster://HOST:PORT,...) for the chunk tier, the tiered store's
Redis tier, the session store and the document registry (whose whole contract also runs on
a cluster in test_registry_contract.py), against a real three-master cluster on loopback ports:
blobs and sessions spread over the masters, a session's keys share one slot, and a master
killed mid-test degrades like a lost single Redis (misses, dropped writes, the memory or
LMDB fallback; no exception, no hang)."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import torch
from redis_cluster import RedisClusterServers

from ragkv.app.chat.contexts import Context, ContextCache, SessionNotFoundError, SessionStoreUnavailableError
from ragkv.app.chat.session_store import RedisSessions
from ragkv.app.chat.shared_contexts import SharedContextConfig
from ragkv.engine.kv_cache import KVCache
from ragkv.ingest.errors import RegistryUnavailableError
from ragkv.ingest.registry import ChunkRecord, DocumentRecord
from ragkv.ingest.registry_url import open_registry
from ragkv.store import ChunkKey, RedisStore, TieredStore, hash_tokens, open_store
from ragkv.store.redis_client import ClusterAddress, hash_tag, redis_client

pytestmark = pytest.mark.redis


@pytest.fixture
def cluster():
    try:
        servers = RedisClusterServers()
    except FileNotFoundError as error:
        pytest.fail(str(error), pytrace=False)
    servers.start()
    yield servers
    servers.cleanup()


def key(i: int) -> ChunkKey:
    return ChunkKey("model-a", hash_tokens([i]), 1)


def chunk(i: int) -> dict[str, torch.Tensor]:
    return {"kv": torch.arange(16, dtype=torch.float16) + i}


def test_cluster_urls_parse_and_refuse_what_a_cluster_cannot_be():
    address = ClusterAddress.parse("redis+cluster://user:p%40ss@h1:7000,h2:7001/")
    assert address.nodes == (("h1", 7000), ("h2", 7001)) and address.password == "p@ss" and not address.tls
    assert ClusterAddress.parse("rediss+cluster://[::1]:7000").tls
    for bad in ("redis+cluster://h1:7000/2", "redis+cluster://h1,h2:7000/", "redis+cluster://h1:99999/"):
        with pytest.raises(ValueError):
            ClusterAddress.parse(bad)
    assert hash_tag("t1:s") == "{t1:s}"
    with pytest.raises(ValueError):
        hash_tag("a}b")
    with pytest.raises(ValueError, match="redis\\+cluster"):
        open_store("tiered+lmdb:///tmp/x?redis=memcached://h:1")


def test_chunk_store_spreads_over_the_masters_and_a_killed_master_is_a_miss(cluster):
    with RedisStore(cluster.url, retry_after_s=0.05) as store:
        keys = [key(i) for i in range(60)]
        store.put_many([(k, chunk(i)) for i, k in enumerate(keys)])
        got = store.get_many(keys)  # one MGET per slot
        assert all(torch.equal(g["kv"], chunk(i)["kv"]) for i, g in enumerate(got))
        owners = Counter(cluster.master_of(k.to_bytes()).port for k in keys)
        assert len(owners) == 3  # every master holds some
        stats = store.stats()
        assert stats.entries == 60 and stats.bytes > 0  # summed over the masters
        assert set(store.iter_keys()) == set(keys)
        assert store.healthy()

        victim = cluster.master_of(keys[0].to_bytes())
        survivors = [k for k in keys if cluster.master_of(k.to_bytes()) is not victim]
        victim.stop()  # refused connections: a miss at once, nothing to wait for
        assert store.get(keys[0]) is None  # its slot is gone: a miss, not an exception
        assert store.get_many(keys[:5]) == [None] * 5  # within the back-off nothing is asked
        store.put(key(1000), chunk(0))  # dropped
        assert not store.healthy()
        assert store.stats().errors >= 1
        time.sleep(0.1)  # past the back-off: keys on the surviving masters answer again
        assert store.get(survivors[0]) is not None


def test_tiered_store_over_a_cluster_serves_from_lmdb_when_a_master_dies(tmp_path, cluster):
    url = f"tiered+lmdb://{tmp_path}/kv?lru_mb=0&redis={cluster.url}"
    with open_store(url) as store:
        assert isinstance(store, TieredStore) and [t.backend for t in store.tiers] == ["lmdb", "redis"]
        keys = [key(i) for i in range(30)]
        store.put_many([(k, chunk(i)) for i, k in enumerate(keys)])
    # A second replica: an empty LMDB of its own, the cluster shared.
    with open_store(f"tiered+lmdb://{tmp_path}/kv2?lru_mb=0&redis={cluster.url}") as replica:
        assert all(g is not None for g in replica.get_many(keys))  # from the cluster, copied into its LMDB
        cluster.nodes[1].stop()
        assert all(torch.equal(g["kv"], chunk(i)["kv"]) for i, g in enumerate(replica.get_many(keys)))
        replica.put(key(500), chunk(5))  # LMDB keeps it; the cluster write may be dropped
        assert replica.get(key(500)) is not None


def _context(context_id: str, n: int, tenant: str = "t1") -> Context:
    cache = KVCache(torch.randn(2, 1, n, 4), torch.randn(2, 1, n, 4), n, n)
    return Context(context_id, tenant, "fp", list(range(n)), list(range(n)), cache, explicit=False)


def _sessions(url: str) -> RedisSessions:
    shared = SharedContextConfig(1 << 20, 60, min_rows=16, min_gain=0)  # what a server builds, smaller
    return RedisSessions(url, ContextCache(1 << 20, 1 << 20, 60), ttl_s=60, lock_ttl_s=10.0, shared=shared)


def _save(sessions: RedisSessions, session_id: str, n: int) -> None:
    sessions.put(_context(session_id, n))
    held = sessions.checkout("t1", session_id)
    held.explicit = True
    sessions.release("t1", session_id, held)


def test_sessions_share_a_slot_per_session_spread_over_masters_and_survive_a_dead_master(cluster):
    replica_a, replica_b = _sessions(cluster.url), _sessions(cluster.url)
    client = redis_client(cluster.url, connect_timeout_s=1, op_timeout_s=1)
    try:
        ids = [f"s{n}" for n in range(12)]
        for session_id in ids:
            _save(replica_a, session_id, 8)
        masters = set()
        for session_id in ids:
            slots = {client.keyslot(f"ragkv:session:{hash_tag('t1:' + session_id)}:{part}") for part in ("kv", "meta")}
            assert len(slots) == 1  # the lock script and the pipeline stay in one slot
            assert client.pttl(f"ragkv:session:{hash_tag('t1:' + session_id)}:kv") > 0
            masters.add(cluster.master_of(f"ragkv:session:{hash_tag('t1:' + session_id)}:kv").port)
        assert len(masters) >= 2
        seen = replica_b.checkout("t1", ids[0])  # the other replica finds it in the cluster
        assert seen.conversation_ids == list(range(8))
        replica_b.release("t1", ids[0], seen)
        with pytest.raises(SessionNotFoundError):
            replica_b.checkout("t2", ids[0])
        assert replica_b.healthy()

        victim = cluster.master_of(f"ragkv:session:{hash_tag('t1:' + ids[1])}:kv")
        victim.stop()  # refused connections: nothing can hang
        context = replica_a.checkout("t1", ids[1])  # its master is gone: A's memory copy answers
        context.turns = 5
        replica_a.release("t1", ids[1], context)
        assert replica_a.checkout("t1", ids[1]).turns == 5
        assert replica_a.healthy() is False and replica_a.stats()["redis_up"] is False
        with pytest.raises(SessionStoreUnavailableError):  # a 503 with Retry-After, not a 404: it exists
            replica_b.checkout("t1", ids[1])  # B never had it in memory and cannot reach its master
    finally:
        client.close()
        replica_a.close()
        replica_b.close()


def test_anonymous_contexts_are_shared_through_the_cluster_one_slot_per_tenant(cluster):
    replica_a, replica_b = _sessions(cluster.url), _sessions(cluster.url)
    client = redis_client(cluster.url, connect_timeout_s=1, op_timeout_s=1)
    try:
        for tenant in ("t1", "t2", "t3"):
            replica_a.put(_context(f"ctx-{tenant}", 64, tenant))
        deadline = time.monotonic() + 10
        while replica_a.shared_contexts.stats.published < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        for tenant in ("t1", "t2", "t3"):
            found = replica_b.match(tenant, "fp", list(range(64)) + [1])
            assert found is not None and found.context.id == f"ctx-{tenant}" and found.conversation_tokens == 64
            keys = client.keys(f"ragkv:context:{hash_tag(tenant)}:*", target_nodes="all")
            assert len({client.keyslot(key) for key in keys}) == 1 and len(keys) > 4  # blob, blocks, LRU, sizes
    finally:
        client.close()
        replica_a.close()
        replica_b.close()


def test_a_cluster_down_at_startup_is_a_redis_down_not_a_failed_start(cluster):
    url = cluster.url
    cluster.cleanup()
    with RedisStore(url, retry_after_s=0.05) as store:
        assert store.get(key(1)) is None and not store.healthy()
    sessions = _sessions(url)
    try:
        assert sessions.healthy() is False
    finally:
        sessions.close()


def test_registry_keeps_each_tenant_in_one_slot_and_counts_shared_chunks_over_tenants(cluster):
    registry = open_registry(cluster.url + "?prefix=reg:", env=None)
    client = redis_client(cluster.url, connect_timeout_s=1, op_timeout_s=1)
    try:
        tenants = [f"tenant{n}" for n in range(8)]
        for tenant in tenants:
            record = _document("doc", tenant, ["shared", f"own-{tenant}"])
            assert registry.add(record, "text", np.eye(4, dtype=np.float32)[:2])
            slots = {client.keyslot(key) for key in registry._keys(tenant)}
            assert len(slots) == 1  # the add/remove scripts and the MULTI stay in one slot
        homes = {tenant: cluster.master_of(registry._keys(tenant)[0]) for tenant in tenants}
        assert len({node.port for node in homes.values()}) >= 2  # tenants spread over the masters
        assert registry.refcount("shared") == len(tenants) and registry.refcount("own-tenant0") == 1
        _, orphans = registry.remove("tenant0", "doc")
        assert orphans == ["own-tenant0"] and registry.refcount("shared") == len(tenants) - 1
        hits = registry.search("tenant1", np.eye(4, dtype=np.float32)[1], top_k=1)
        assert [(hit.doc_id, hit.chunk_index) for hit in hits] == [("doc", 1)]

        victim = homes["tenant2"]
        victim.stop()
        with pytest.raises(RegistryUnavailableError):
            registry.list("tenant2")  # its master is gone: the corpus of this tenant is unavailable
        alive = next(t for t in tenants[1:] if homes[t] is not victim)
        assert [r.doc_id for r in registry.list(alive)] == ["doc"]  # the others' still answer
        assert registry.healthy() is False
    finally:
        client.close()
        registry.close()


def _document(doc_id: str, tenant: str, chunk_hashes: list[str]) -> DocumentRecord:
    chunks = [ChunkRecord(i, h, i * 4, i * 4 + 4, i * 10, i * 10 + 10) for i, h in enumerate(chunk_hashes)]
    return DocumentRecord(
        doc_id, tenant, f"{doc_id}.txt", f"hash-{doc_id}", 4 * len(chunks), 4, "fp", time.time(), chunks, {}
    )
