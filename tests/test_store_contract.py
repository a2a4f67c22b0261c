"""The ChunkStore contract, run unchanged against every backend.

Every backend (LMDB, a real Redis, and the tiered LRU+LMDB+Redis stack) must
behave the same through the public API; backend-specific behaviour (restarts,
outages, map growth) lives in the per-backend test files.
"""

from __future__ import annotations

import pytest
import redis
import torch

from ragkv.store import (
    ChunkKey,
    ChunkStore,
    LMDBStore,
    RedisStore,
    StoreError,
    TieredStore,
    encode_blob,
    hash_tokens,
    key_prefix,
)

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@pytest.fixture(
    params=["lmdb", pytest.param("redis", marks=pytest.mark.redis), pytest.param("tiered", marks=pytest.mark.redis)]
)
def store(request: pytest.FixtureRequest, tmp_path) -> ChunkStore:
    if request.param != "lmdb":
        url = request.getfixturevalue("redis_url")
        client = redis.Redis.from_url(url)
        client.flushdb()
        client.close()
    if request.param == "lmdb":
        opened: ChunkStore = LMDBStore(tmp_path / "kv")
    elif request.param == "redis":
        opened = RedisStore(url)
    else:
        opened = TieredStore([LMDBStore(tmp_path / "kv"), RedisStore(url)], lru_bytes=1 << 20)
    yield opened
    opened.close()


def key(i: int, model: str = "model-a", version: int = 1) -> ChunkKey:
    return ChunkKey(model, hash_tokens([i, i + 1]), version)


def sample(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A [layers, heads, tokens, dim] tensor including the awkward values of its dtype."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, 2, 8, 4)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
        flat = t.view(-1)
        info = torch.finfo(dtype)
        flat[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, info.tiny, info.max]).to(dtype)
        return t
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)
    t.view(-1)[:2] = torch.tensor([info.min, info.max], dtype=dtype)
    return t


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert got[name].shape == want[name].shape
        assert bits(got[name]) == bits(want[name]), name


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_bit_exact(store: ChunkStore, dtype: torch.dtype) -> None:
    chunk = {"keys": sample(dtype, 1), "values": sample(dtype, 2)}
    store.put(key(1), chunk, {"doc_id": "d-7", "tokens": "8"})
    assert_same(store.get(key(1)), chunk)
    entry = store.get_entry(key(1))
    assert entry.metadata == {"doc_id": "d-7", "tokens": "8"}
    assert_same(entry.tensors, chunk)


def test_get_many_keeps_order_and_reports_misses(store: ChunkStore) -> None:
    chunks = {i: {"kv": torch.full((3, 5), float(i), dtype=torch.float16)} for i in (1, 3, 4)}
    store.put_many([(key(i), chunk) for i, chunk in chunks.items()])
    got = store.get_many([key(4), key(2), key(1), key(5), key(3)])
    assert [g is None for g in got] == [False, True, False, True, False]
    for i, g in zip([4, 1, 3], [got[0], got[2], got[4]]):
        assert_same(g, chunks[i])
    assert store.get_many([]) == []


def test_put_many_accepts_metadata_per_item(store: ChunkStore) -> None:
    store.put_many([(key(1), {"a": torch.zeros(2)}, {"n": "1"}), (key(2), {"a": torch.ones(2)})])
    assert store.get_entry(key(1)).metadata == {"n": "1"}
    assert store.get_entry(key(2)).metadata == {}


def test_contains_and_delete(store: ChunkStore) -> None:
    store.put(key(1), {"a": torch.arange(4)})
    assert store.contains(key(1))
    assert not store.contains(key(2))
    assert store.delete(key(1))
    assert not store.delete(key(1))
    assert not store.contains(key(1))
    assert store.get(key(1)) is None


def test_overwrite_replaces_the_value(store: ChunkStore) -> None:
    store.put(key(1), {"a": torch.zeros(4)})
    assert store.get(key(1))["a"].sum() == 0  # also warms any cache tier
    store.put(key(1), {"a": torch.ones(4)})
    assert store.get(key(1))["a"].sum() == 4


def test_stats_count_hits_misses_and_entries(store: ChunkStore) -> None:
    store.put_many([(key(1), {"a": torch.zeros(64)}), (key(2), {"a": torch.ones(64)})])
    store.get(key(1))
    store.get(key(9))
    store.get_many([key(1), key(8), key(2)])
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.corrupt, stats.errors) == (3, 2, 0, 0)
    assert stats.entries == 2
    assert stats.bytes > 0
    assert stats.backend == type(store).backend
    as_dict = stats.to_dict()
    assert as_dict["hits"] == 3 and as_dict["backend"] == stats.backend


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bit_flip", "empty"])
def test_corrupt_blob_is_a_counted_miss_and_is_dropped(store: ChunkStore, damage: str) -> None:
    good = encode_blob({"a": torch.arange(64, dtype=torch.float32)})
    bad = {
        "garbage": b"this is not a safetensors blob",
        "truncated": good[: len(good) - 7],
        "bit_flip": good[:-9] + bytes([good[-9] ^ 0x10]) + good[-8:],
        "empty": b"",
    }[damage]
    store._put_raw_many([(key(1).to_bytes(), bad)])  # below the encoder: what a bad disk would do
    assert store.get(key(1)) is None
    stats = store.stats()
    assert stats.corrupt >= 1
    assert stats.misses == 1 and stats.hits == 0
    assert not store.contains(key(1))  # dropped, so it is recomputed and rewritten
    store.put(key(1), {"a": torch.ones(2)})
    assert store.get(key(1))["a"].tolist() == [1.0, 1.0]


def test_keys_distinguish_model_and_format_version(store: ChunkStore) -> None:
    base, other_model, other_version = key(1), key(1, model="model-b"), key(1, version=2)
    store.put(base, {"a": torch.zeros(2)})
    assert store.get(other_model) is None
    assert store.get(other_version) is None
    store.put(other_model, {"a": torch.ones(2)})
    store.put(other_version, {"a": torch.full((2,), 2.0)})
    assert [store.get(k)["a"][0].item() for k in (base, other_model, other_version)] == [0.0, 1.0, 2.0]


def test_iter_keys_filters_by_prefix(store: ChunkStore) -> None:
    keys = [key(1), key(2), key(3, model="model-b"), key(4, version=2)]
    store.put_many([(k, {"a": torch.zeros(1)}) for k in keys])
    assert set(store.iter_keys()) == set(keys)
    assert set(store.iter_keys(key_prefix(1, "model-a"))) == {key(1), key(2)}
    assert set(store.iter_keys(key_prefix(2))) == {key(4, version=2)}


def test_rejects_wrong_key_types(store: ChunkStore) -> None:
    with pytest.raises(TypeError):
        store.get("kv/1/model-a/abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.put_many([("not-a-key", {"a": torch.zeros(1)})])  # type: ignore[list-item]


def test_closed_store_refuses_use(store: ChunkStore) -> None:
    with store:
        store.put(key(1), {"a": torch.zeros(1)})
    with pytest.raises(StoreError, match="closed"):
        store.get(key(1))
    store.close()  # idempotent
