"""open_store URL parsing."""

from __future__ import annotations

import pytest

from ragkv.store import LMDBStore, RedisStore, TieredStore, open_store


def test_lmdb_absolute_and_relative(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_store(f"lmdb://{tmp_path}/abs?map_size=1048576") as store:
        assert isinstance(store, LMDBStore) and store.path == str(tmp_path / "abs")
    monkeypatch.chdir(tmp_path)
    with open_store("lmdb://rel/dir") as store:
        assert store.path == str(tmp_path / "rel" / "dir")


@pytest.mark.redis
def test_redis_and_tiered(tmp_path, redis_url: str) -> None:
    with open_store(redis_url, ttl=60, timeout=2) as store:
        assert isinstance(store, RedisStore) and store.healthy()
    url = f"tiered+lmdb://{tmp_path}/kv?lru_mb=8&redis={redis_url}&redis_ttl=60"
    with open_store(url) as store:
        assert isinstance(store, TieredStore)
        assert [type(t) for t in store.tiers] == [LMDBStore, RedisStore]
        assert store.stats().lru.capacity_bytes == 8 << 20
    with open_store(f"tiered+lmdb://{tmp_path}/kv", lru_mb=0) as store:
        assert len(store.tiers) == 1 and store.stats().lru.capacity_bytes == 0


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://bucket/kv", "unknown store URL scheme"),
        ("lmdb://", "names no LMDB directory"),
        ("lmdb:///tmp/x?mapsize=1", "unknown parameter 'mapsize'"),
        ("lmdb:///tmp/x?map_size=big", "bad value"),
        ("lmdb:///tmp/x?map_size=1&map_size=2", "repeats"),
        ("redis://localhost:6379/0?ttl=-1", "ttl_s must be a positive number"),
        ("tiered+lmdb:///tmp/x?redis=http://h", "bad value"),
    ],
)
def test_bad_urls_are_explained(url: str, message: str, tmp_path) -> None:
    with pytest.raises(ValueError, match=message):
        open_store(url.replace("/tmp/x", str(tmp_path / "x")))
