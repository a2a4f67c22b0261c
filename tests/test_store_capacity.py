"""LMDB store capacity: least-recently-used eviction under a real LMDB file."""

from __future__ import annotations

import os

import pytest
import torch

from ragkv.store.keys import ChunkKey, hash_tokens
from ragkv.store.lmdb_store import LMDBStore
from ragkv.store.url import open_store

BLOB_FLOATS = 64 * 1024  # 256 KiB of float32 per chunk: overflow pages, like real chunk KV


def key(i: int) -> ChunkKey:
    return ChunkKey("capacity-test", hash_tokens([i]), 1)


def payload(i: int) -> dict[str, torch.Tensor]:
    return {"keys": torch.full((BLOB_FLOATS,), float(i))}


def chunk_bytes(tmp_path) -> int:
    """What one chunk occupies in LMDB pages (the unit the capacity counts)."""
    with LMDBStore(tmp_path / "probe") as probe:
        probe.put(key(0), payload(0))
        return probe.stats().bytes


def test_capacity_bounds_the_store_and_its_file(tmp_path):
    capacity = 5 * chunk_bytes(tmp_path)
    with LMDBStore(tmp_path / "db", capacity_bytes=capacity) as store:
        for i in range(40):
            store.put(key(i), payload(i))
            assert store.stats().bytes <= capacity
        stats = store.stats()
        assert stats.entries == 5 and stats.evictions == 35 and stats.capacity_bytes == capacity
        assert [store.get(key(i)) is not None for i in range(35, 40)] == [True] * 5
        assert store.get(key(0)) is None
    # Freed pages are reused, so the file stays near the bound instead of growing with every write.
    assert os.path.getsize(tmp_path / "db" / "data.mdb") <= 3 * capacity


def test_least_recently_used_goes_first(tmp_path):
    capacity = 3 * chunk_bytes(tmp_path)
    with LMDBStore(tmp_path / "db", capacity_bytes=capacity) as store:
        for i in range(3):
            store.put(key(i), payload(i))
        assert store.get(key(0)) is not None  # 0 is now used more recently than 1 and 2
    # A new handle has no pinned reads: only the recorded last uses decide.
    with LMDBStore(tmp_path / "db", capacity_bytes=capacity) as store:
        store.put(key(3), payload(3))
        assert [store.contains(key(i)) for i in range(4)] == [True, False, True, True]  # contains() is no use
        store.put(key(4), payload(4))
        assert [store.contains(key(i)) for i in range(5)] == [True, False, False, True, True]
        assert store.stats().evictions == 2


def test_chunks_a_query_just_read_are_never_evicted(tmp_path):
    capacity = 2 * chunk_bytes(tmp_path)
    with LMDBStore(tmp_path / "db", capacity_bytes=capacity) as store:
        store.put_many([(key(0), payload(0)), (key(1), payload(1))])
        assert all(t is not None for t in store.get_many([key(0), key(1)]))
        store.put(key(2), payload(2))  # a recomputed miss written back by the same query
        assert all(t is not None for t in store.get_many([key(0), key(1), key(2)]))
        assert store.stats().evictions == 0


def test_chunks_written_before_a_capacity_was_set_are_evicted_first(tmp_path):
    one = chunk_bytes(tmp_path)
    with LMDBStore(tmp_path / "db") as unbounded:
        for i in range(3):
            unbounded.put(key(i), payload(i))
    with open_store(f"lmdb://{tmp_path / 'db'}?capacity={3 * one}") as store:
        assert store.get(key(2)) is not None
        store.put(key(3), payload(3))
        assert store.get(key(0)) is None and store.get(key(2)) is not None and store.stats().evictions == 1


def test_deleted_chunks_leave_no_recency_behind(tmp_path):
    capacity = 2 * chunk_bytes(tmp_path)
    with LMDBStore(tmp_path / "db", capacity_bytes=capacity) as store:
        store.put(key(0), payload(0))
        assert store.delete(key(0))
        for i in (1, 2, 3):
            store.put(key(i), payload(i))
        assert store.stats().evictions == 1 and store.get(key(1)) is None


@pytest.mark.parametrize("bad", [0, -5, True, 1.5])
def test_capacity_must_be_a_positive_int(tmp_path, bad):
    with pytest.raises(ValueError, match="capacity"):
        LMDBStore(tmp_path / "db", capacity_bytes=bad)


def test_redis_urls_refuse_a_capacity():
    with pytest.raises(ValueError, match="capacity"):
        open_store("redis://127.0.0.1:1/0", capacity=1 << 20)
