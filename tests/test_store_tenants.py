"""Per-tenant byte counts of the chunk stores, checked against a full scan of what they hold:
after puts, replacements, deletes and evictions, and after the store is closed and opened
again (LMDB, a real redis-server, a real Redis Cluster)."""

from __future__ import annotations

import pytest
import redis
import torch

from ragkv.store import ChunkKey, ChunkStore, LMDBStore, RedisStore, hash_tokens
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.tenant_bytes import TENANTS_DB


def key(i: int, tenant: str) -> ChunkKey:
    return ChunkKey("model-a", hash_tokens([i]), 1, tenant)


def tensors(size: int) -> dict[str, torch.Tensor]:
    return {"k": torch.arange(size, dtype=torch.int32)}


def scanned(store: ChunkStore) -> dict[str, int]:
    """Bytes per tenant from a full scan of the keys and their blob sizes: the reference."""
    totals: dict[str, int] = {}
    for stored in store.iter_keys():
        totals[stored.tenant] = totals.get(stored.tenant, 0) + (store.blob_size(stored) or 0)
    return totals


def churn(store: ChunkStore) -> None:
    """Writes of three tenants and shared chunks, a replacement with another size, deletes."""
    for i in range(12):
        store.put(key(i, ("alice", "bob", "")[i % 3]), tensors(16 + 8 * i))
    store.put_many([(key(100 + i, "carol"), tensors(40)) for i in range(5)])
    store.put(key(0, "alice"), tensors(300))  # replaced, larger
    store.put(key(1, "bob"), tensors(4))  # replaced, smaller
    assert store.delete(key(2, ""))
    assert not store.delete(key(2, ""))  # already gone: no double count
    assert store.delete(key(100, "carol"))


def test_lmdb_counts_match_a_full_scan_across_a_restart(tmp_path) -> None:
    with LMDBStore(tmp_path / "kv") as store:
        churn(store)
        counted = store.tenant_bytes()
        assert counted == scanned(store) and set(counted) == {"alice", "bob", "", "carol"}
    with LMDBStore(tmp_path / "kv") as reopened:
        assert reopened.tenant_bytes() == counted == scanned(reopened)
        assert reopened.recount() == counted


def test_lmdb_counts_hold_through_evictions(tmp_path) -> None:
    with LMDBStore(tmp_path / "kv", capacity_bytes=64 << 10) as store:
        for i in range(200):
            store.put(key(i, ("alice", "bob")[i % 2]), tensors(200))
        assert store.stats().evictions > 0
        assert store.tenant_bytes() == scanned(store)


def test_lmdb_store_without_counts_is_recounted_when_opened(tmp_path) -> None:
    with LMDBStore(tmp_path / "kv") as store:
        churn(store)
        want = scanned(store)
    with LMDBEnvironment(tmp_path / "kv") as env:  # what a store written before counts looks like
        tenants = env.db(TENANTS_DB)
        env.write(lambda txn: txn.drop(tenants, delete=False))
    with LMDBStore(tmp_path / "kv") as reopened:
        assert reopened.tenant_bytes() == want


@pytest.mark.redis
def test_redis_counts_match_a_full_scan_across_a_restart(redis_url) -> None:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    with RedisStore(redis_url) as store:
        churn(store)
        counted = store.tenant_bytes()
        assert counted == scanned(store) and set(counted) == {"alice", "bob", "", "carol"}
        assert store.stats().entries == sum(1 for _ in store.iter_keys())  # the counter is not an entry
    with RedisStore(redis_url) as reopened:
        assert reopened.tenant_bytes() == counted == scanned(reopened)
        client.hset(b"ragkv/tenant-bytes", "alice", 1)  # a count gone wrong (a blob expired, say)
        assert reopened.recount() == counted == reopened.tenant_bytes()
    client.close()


@pytest.mark.redis
def test_redis_cluster_counts_match_a_full_scan_across_a_restart(redis_cluster_url) -> None:
    with RedisStore(redis_cluster_url) as store:
        store._client.flushall(target_nodes="primaries")
        churn(store)
        counted = store.tenant_bytes()
        assert counted == scanned(store) and set(counted) == {"alice", "bob", "", "carol"}
        assert store.stats().entries == sum(1 for _ in store.iter_keys())
    with RedisStore(redis_cluster_url) as reopened:
        assert reopened.tenant_bytes() == counted == scanned(reopened)
        assert reopened.recount() == counted
