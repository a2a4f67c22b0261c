"""Redis is a cache that may vanish: outages are misses and dropped writes, never exceptions."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import redis
import torch
from redis_server import RedisServer  # pytest puts tests/ on sys.path (no tests/__init__.py)

from ragkv.store import ChunkKey, LMDBStore, RedisStore, TieredStore, hash_tokens, open_store

pytestmark = pytest.mark.redis


def key(i: int) -> ChunkKey:
    return ChunkKey("model-a", hash_tokens([i]), 1)


CHUNK = {"kv": torch.arange(16, dtype=torch.float16)}


def test_killed_redis_is_a_miss_and_writes_are_dropped(killable_redis: RedisServer) -> None:
    with RedisStore(killable_redis.url, retry_after_s=0.05) as store:
        store.put(key(1), CHUNK)
        assert store.get(key(1)) is not None
        assert store.healthy()
        killable_redis.stop()

        assert store.get(key(1)) is None
        assert store.get_many([key(1), key(2)]) == [None, None]
        store.put(key(3), CHUNK)
        store.put_many([(key(4), CHUNK)])
        assert store.contains(key(1)) is False
        assert store.delete(key(1)) is False
        assert list(store.iter_keys()) == []
        assert not store.healthy()

        stats = store.stats()
        assert stats.entries is None and stats.bytes is None
        assert stats.errors >= 7
        assert stats.misses == 3  # get + get_many's two keys; contains/delete are not lookups


def test_store_recovers_when_redis_comes_back(killable_redis: RedisServer) -> None:
    with RedisStore(killable_redis.url, retry_after_s=0.05) as store:
        killable_redis.stop()
        assert store.get(key(1)) is None
        killable_redis.start()
        time.sleep(0.06)  # past the back-off
        store.put(key(1), CHUNK)
        assert store.get(key(1)) is not None


def test_outage_is_logged_once_per_burst(killable_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    with RedisStore(killable_redis.url, retry_after_s=0.05) as store:
        killable_redis.stop()
        with caplog.at_level(logging.WARNING, logger="ragkv.store"):
            for i in range(20):
                store.get(key(i))
                store.put(key(i), CHUNK)
            killable_redis.start()
            time.sleep(0.06)
            store.get(key(1))
        messages = [r.getMessage() for r in caplog.records if r.name == "ragkv.store"]
        assert sum("unavailable" in m for m in messages) == 1
        assert sum("recovered after 40 failed" in m for m in messages) == 1


def _connections(listener: socket.socket) -> int:
    """How many connections reached `listener` since the last call (taken off its backlog)."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            return count
        connection.close()
        count += 1


def test_unresponsive_redis_times_out_once_then_fails_fast() -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        with RedisStore(url, op_timeout_s=0.2, connect_timeout_s=0.2, retry_after_s=30) as store:
            # no call waits past the timeouts given (a wait the client's own settings bound)
            settings = store._client.connection_pool.connection_kwargs
            assert (settings["socket_connect_timeout"], settings["socket_timeout"]) == (0.2, 0.2)
            assert store.get(key(1)) is None  # timed out: a miss
            assert _connections(silent) == 1  # one try, not retried
            for _ in range(50):
                assert store.get(key(1)) is None
                store.put(key(1), CHUNK)
            assert _connections(silent) == 0  # backing off: Redis not contacted
            assert store.stats().errors >= 101


def test_ttl_is_applied(redis_url: str) -> None:
    with open_store(redis_url + "?ttl=30") as store:
        store.put(key(1), CHUNK)
        client = redis.Redis.from_url(redis_url)
        assert 0 < client.pttl(key(1).to_bytes()) <= 30_000
        client.close()


def test_tiered_store_keeps_serving_from_lmdb_when_redis_dies(tmp_path, killable_redis: RedisServer) -> None:
    store = TieredStore([LMDBStore(tmp_path / "kv"), RedisStore(killable_redis.url, retry_after_s=0.05)], lru_bytes=0)
    with store:
        store.put(key(1), CHUNK)
        killable_redis.stop()
        assert torch.equal(store.get(key(1))["kv"], CHUNK["kv"])
        store.put(key(2), CHUNK)  # lands in LMDB, the Redis half is dropped
        assert store.get(key(2)) is not None
        assert store.get(key(3)) is None  # a miss in both tiers, Redis' part absorbed
        stats = store.stats()
        lmdb_stats, redis_stats = stats.tiers
        assert lmdb_stats.entries == 2
        assert redis_stats.errors >= 2 and stats.errors == redis_stats.errors
        assert (stats.hits, stats.misses) == (2, 1)


def test_kv_planted_in_a_shared_redis_without_the_secret_is_a_corrupt_miss(redis_url: str) -> None:
    planted = {"kv": torch.full((16,), 7.0, dtype=torch.float16)}
    with open_store(redis_url) as intruder, open_store(redis_url, secret="deployment secret") as store:
        intruder.put(key(900), planted)  # a valid CRC-32 under the predictable key
        assert store.get(key(900)) is None and store.stats().corrupt == 1
        assert not intruder.contains(key(900))  # dropped, so the deployment recomputes and rewrites it
        store.put(key(900), CHUNK)
        assert torch.equal(store.get(key(900))["kv"], CHUNK["kv"])
        assert intruder.get(key(900)) is None  # and the deployment's blob is useless without the secret
