"""Tiered store: LRU hits, read-through promotion between tiers, repair of corrupt copies."""

from __future__ import annotations

import pytest
import redis
import torch

from ragkv.store import ChunkKey, LMDBStore, RedisStore, TieredStore, hash_tokens

pytestmark = pytest.mark.redis


def key(i: int) -> ChunkKey:
    return ChunkKey("model-a", hash_tokens([i]), 1)


CHUNK = {"kv": torch.arange(256, dtype=torch.float16)}


@pytest.fixture
def tiers(tmp_path, redis_url: str) -> tuple[LMDBStore, RedisStore]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    return LMDBStore(tmp_path / "kv"), RedisStore(redis_url)


def test_lru_serves_repeat_reads_without_touching_tiers(tiers) -> None:
    with TieredStore(tiers, lru_bytes=1 << 20) as store:
        store.put(key(1), CHUNK)
        first = store.get(key(1))
        second = store.get(key(1))
        assert second is first  # the same decoded tensors: no I/O, no copy
        stats = store.stats()
        assert stats.lru.hits == 1 and stats.lru.entries == 1
        assert stats.tiers[0].hits == 1  # only the first read reached LMDB
        assert stats.hits == 2


def test_lower_tier_hit_populates_upper_tiers(tiers) -> None:
    lmdb_store, redis_store = tiers
    redis_store.put(key(1), CHUNK)  # only Redis has it, e.g. written by another replica
    with TieredStore(tiers, lru_bytes=0) as store:
        assert torch.equal(store.get(key(1))["kv"], CHUNK["kv"])
        assert lmdb_store.contains(key(1))
        assert store.get(key(1)) is not None
        lmdb_stats, redis_stats = store.stats().tiers
        assert (lmdb_stats.hits, lmdb_stats.misses) == (1, 1)
        assert (redis_stats.hits, redis_stats.misses) == (1, 0)


def test_corrupt_upper_copy_is_repaired_from_lower_tier(tiers) -> None:
    lmdb_store, _ = tiers
    with TieredStore(tiers, lru_bytes=0) as store:
        store.put(key(1), CHUNK)
        lmdb_store._put_raw_many([(key(1).to_bytes(), b"bit rot")])
        assert torch.equal(store.get(key(1))["kv"], CHUNK["kv"])  # served from Redis
        assert store.stats().corrupt == 1
        assert torch.equal(lmdb_store.get(key(1))["kv"], CHUNK["kv"])  # LMDB rewritten


def test_writes_and_deletes_reach_every_tier_and_the_lru(tiers) -> None:
    lmdb_store, redis_store = tiers
    with TieredStore(tiers, lru_bytes=1 << 20) as store:
        store.put(key(1), CHUNK)
        assert lmdb_store.contains(key(1)) and redis_store.contains(key(1))
        store.get(key(1))
        assert store.delete(key(1))
        assert not lmdb_store.contains(key(1)) and not redis_store.contains(key(1))
        assert store.get(key(1)) is None  # not resurrected from the LRU
        assert store.stats().entries == 0


def test_closing_the_tiered_store_closes_its_tiers(tiers) -> None:
    store = TieredStore(tiers)
    store.close()
    assert all(tier._closed for tier in tiers)


def test_rejects_bad_tier_lists(tiers) -> None:
    lmdb_store, _ = tiers
    with pytest.raises(ValueError):
        TieredStore([])
    with pytest.raises(ValueError, match="twice"):
        TieredStore([lmdb_store, lmdb_store])
    with pytest.raises(TypeError):
        TieredStore([object()])  # type: ignore[list-item]
    for tier in tiers:
        tier.close()
