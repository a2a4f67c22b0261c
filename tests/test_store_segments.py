"""Segmented LRU in the LMDB store: chunks read since they were written are evicted after
those never read, within a bounded protected share; checked against a reference model."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from ragkv.store.keys import ChunkKey, hash_tokens
from ragkv.store.lmdb_store import LMDBStore
from ragkv.store.recency import USE_DB, RecencyIndex, Use
from ragkv.store.url import open_store

BLOB_FLOATS = 16 * 1024  # 64 KiB chunks: overflow pages, like real chunk KV


def key(i: int) -> ChunkKey:
    return ChunkKey("segments-test", hash_tokens([i]), 1)


def payload(i: int) -> dict[str, torch.Tensor]:
    return {"keys": torch.full((BLOB_FLOATS,), float(i))}


@pytest.fixture
def one(tmp_path) -> int:
    """Bytes one chunk occupies in LMDB pages (the unit the capacity counts)."""
    with LMDBStore(tmp_path / "probe") as probe:
        probe.put(key(0), payload(0))
        return probe.stats().bytes


def fresh_reads(store: LMDBStore, *ids: int) -> None:
    """Reads that count as uses but leave nothing pinned (as from another process)."""
    assert all(t is not None for t in store.get_many([key(i) for i in ids]))
    store._touches._recent.clear()


def held(store: LMDBStore, ids) -> list[int]:
    return [i for i in ids if store.contains(key(i))]


def test_a_chunk_read_once_outlives_a_flood_of_one_off_writes(tmp_path, one):
    with (
        LMDBStore(tmp_path / "slru", capacity_bytes=4 * one) as slru,
        LMDBStore(tmp_path / "lru", capacity_bytes=4 * one, protected_share=0) as lru,
    ):
        for store in (slru, lru):
            store.put(key(0), payload(0))
            fresh_reads(store, 0)
            for i in range(1, 20):  # nothing else is ever read again
                store.put(key(i), payload(i))
        assert held(slru, range(20)) == [0, 17, 18, 19]
        assert held(lru, range(20)) == [16, 17, 18, 19]


def test_the_protected_share_is_bounded_and_its_oldest_is_demoted(tmp_path, one):
    # Half of four chunks protected: a third chunk read demotes the least recently read one.
    with LMDBStore(tmp_path / "db", capacity_bytes=4 * one, protected_share=0.5) as store:
        for i in range(4):
            store.put(key(i), payload(i))
        fresh_reads(store, 0)
        fresh_reads(store, 1)
        fresh_reads(store, 2)  # 0 goes back to probation, as its youngest
        store.put(key(4), payload(4))  # evicts probation's oldest: 3, then 0
        store.put(key(5), payload(5))
        assert held(store, range(6)) == [1, 2, 4, 5]


def test_segments_survive_a_reopen_and_a_delete_frees_protected_bytes(tmp_path, one):
    with LMDBStore(tmp_path / "db", capacity_bytes=3 * one) as store:
        for i in range(3):
            store.put(key(i), payload(i))
        fresh_reads(store, 0)
    with LMDBStore(tmp_path / "db", capacity_bytes=3 * one) as store:
        store.put(key(3), payload(3))
        store.put(key(4), payload(4))
        assert held(store, range(5)) == [0, 3, 4]
        assert protected_bytes(store) > 0
        assert store.delete(key(0))
        assert protected_bytes(store) == 0


def test_chunks_recorded_before_segments_existed_read_as_probation():
    raw = (12345).to_bytes(8, "big")
    assert Use.decode(raw) == Use(raw)
    protected = Use(raw, True, 99)
    assert Use.decode(protected.encode()) == protected
    assert protected.order(b"k") > Use(b"\xfe" + raw[1:]).order(b"k")  # every protected after probation


def test_protected_bytes_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="protected_bytes"):
        RecencyIndex(None, None, None, protected_bytes=-1)


@pytest.mark.parametrize("bad", [1, 1.5, -0.1, "0.5", True])
def test_the_protected_share_is_checked(tmp_path, bad):
    with pytest.raises(ValueError, match="protected_share"):
        LMDBStore(tmp_path / "db", capacity_bytes=1 << 20, protected_share=bad)


def test_the_store_url_takes_the_protected_share(tmp_path):
    with open_store(f"lmdb://{tmp_path / 'a'}?capacity=1000000&protected=0") as store:
        assert store.protected_share == 0
    with open_store(f"lmdb://{tmp_path / 'b'}?capacity=1000000") as store:
        assert store.protected_share == 0.65
    with pytest.raises(ValueError, match="protected"):
        open_store(f"lmdb://{tmp_path / 'c'}?protected=1.5")


def protected_bytes(store: LMDBStore) -> int:
    with store._env.read() as txn:
        return store._recency.protected_bytes(txn)


def recorded_protected_bytes(store: LMDBStore) -> int:
    """The protected segment's bytes summed over its chunks' records."""
    with store._env.read() as txn:
        records = (Use.decode(bytes(v)) for _, v in txn.cursor(db=store._env.db(USE_DB)).iternext())
        return sum(use.size for use in records if use.protected)


class ReferenceSLRU:
    """The policy in plain Python: probation and protected LRU lists of equal-size chunks."""

    def __init__(self, capacity: int, protected: int) -> None:
        self.capacity, self.protected_cap = capacity, protected
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()

    def read(self, i: int) -> bool:
        if i in self.protected:
            self.protected.move_to_end(i)
        elif i in self.probation:
            del self.probation[i]
            self.protected[i] = None
            while len(self.protected) > self.protected_cap:
                demoted, _ = self.protected.popitem(last=False)
                self.probation[demoted] = None
        else:
            return False
        return True

    def write(self, i: int) -> None:
        if i not in self.protected:
            self.probation.pop(i, None)
            self.probation[i] = None
        while len(self.probation) + len(self.protected) > self.capacity:
            segment = self.probation if len(self.probation) > 1 or not self.protected else self.protected
            oldest = next(k for k in segment if k != i)
            del segment[oldest]

    def held(self) -> set[int]:
        return set(self.probation) | set(self.protected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_reads_and_writes_match_the_reference_policy(tmp_path, one, seed):
    rng = random.Random(seed)
    capacity, share = 6, 0.5
    with LMDBStore(tmp_path / "probe") as probe:
        probe.put(key(0), payload(0))
        blob_bytes = probe._size_raw(key(0).to_bytes())  # the protected share counts blob bytes
    with LMDBStore(tmp_path / "db", capacity_bytes=capacity * one, protected_share=share) as store:
        model = ReferenceSLRU(capacity, int(share * capacity * one) // blob_bytes)
        for _ in range(120):
            i = rng.randrange(12)
            if rng.random() < 0.5:
                found = store.get(key(i)) is not None
                store._touches._recent.clear()
                store._env.write(store._write_touches)  # the use recorded now, in order
                assert found == model.read(i)
            elif not store.contains(key(i)):
                store.put(key(i), payload(i))
                model.write(i)
            assert set(held(store, range(12))) == model.held()
            assert protected_bytes(store) == recorded_protected_bytes(store)


def test_reads_served_from_the_tiered_memory_count_as_uses_below(tmp_path, one):
    # Plain LRU below a memory tier: 0 is read from LMDB once, then only from memory.
    url = f"tiered+lmdb://{tmp_path / 'db'}?capacity={3 * one}&protected=0&lru_mb=64"
    with open_store(url) as store:
        lmdb = store.tiers[0]
        for i in range(3):
            store.put(key(i), payload(i))
        for i in (0, 2, 0):  # the second read of 0 comes from memory, after 2's
            assert store.get(key(i)) is not None
        lmdb._touches._recent.clear()
        store.put(key(3), payload(3))  # evicts 1
        store.put(key(4), payload(4))  # evicts 2, whose last use is older than 0's
        assert held(lmdb, range(5)) == [0, 3, 4]


def test_stats_show_the_protected_bytes_of_a_capped_store(tmp_path, one):
    with open_store(f"tiered+lmdb://{tmp_path / 'db'}?capacity={4 * one}&lru_mb=0") as store:
        store.put(key(0), payload(0))
        assert store.stats().protected_bytes == 0
        assert store.get(key(0)) is not None
        store.put(key(1), payload(1))  # writes the read's use
        stats = store.stats()
        assert 0 < stats.protected_bytes == stats.tiers[0].protected_bytes <= one
        assert stats.to_dict()["tiers"][0]["protected_bytes"] == stats.protected_bytes
    with LMDBStore(tmp_path / "unbounded") as store:
        assert store.stats().protected_bytes is None


def test_a_deployment_sets_the_protected_share_with_its_capacity(tmp_path):
    from ragkv.app.storage import Storage
    from ragkv.app.storage_config import StorageConfig

    config = StorageConfig(data_dir=tmp_path / "data", store_capacity=1 << 20, store_protected_share=0.0)
    with Storage(config) as storage:
        assert storage.store.capacity_bytes == 1 << 20 and storage.store.protected_share == 0.0
    with Storage(StorageConfig(data_dir=tmp_path / "data", store_capacity=1 << 20)) as storage:
        assert storage.store.protected_share == 0.65
    with pytest.raises(ValueError, match="store_protected_share"):
        StorageConfig(data_dir=tmp_path / "data", store_protected_share=1.0)
