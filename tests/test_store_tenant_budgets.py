"""Per-tenant budgets and fair shares of the LMDB store, against a reference: the keys that
survive a sequence of writes from several tenants are those a plain model of the rule keeps,
computed here from the write order alone (every chunk the same size, so the store holds N
of them at its capacity; nothing is read back, so each tenant's LRU order is its write
order). Counts are also checked against a full scan after the store is opened again."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import redis
import torch

from ragkv.store import ChunkKey, LMDBStore, RedisStore, TieredStore, hash_tokens
from ragkv.store.recency import SEGMENT_DB, TENANT_LRU_DB
from ragkv.store.tenant_budgets import TenantBudgets, fair_share_order

HELD = 10  # chunks the capped store holds


def key(tenant: str, i: int) -> ChunkKey:
    return ChunkKey("model-a", hash_tokens([i], tenant), 1, tenant)


def blob() -> dict[str, torch.Tensor]:
    return {"k": torch.zeros(64 * 1024, dtype=torch.uint8)}  # overflow pages: the page count is exact


def chunk_geometry(tmp_path) -> tuple[int, int]:
    """(pages one chunk takes, its blob bytes), read from a store holding just one."""
    with LMDBStore(tmp_path / "probe") as probe:
        probe.put(key("a", -1), blob())
        size = probe.blob_size(key("a", -1))
        pages = probe.stats().bytes // 4096 - 1  # less the one leaf page
    return pages, size


def capped(path, geometry: tuple[int, int], held: int | None = HELD) -> LMDBStore:
    """A store whose capacity is `held` chunks and half of one (room for the tree's pages)."""
    pages = geometry[0]
    capacity = None if held is None else (held * pages + pages // 2) * 4096
    return LMDBStore(path, capacity_bytes=capacity)


def reference(writes: list[tuple[str, int]], held: int | None, budgets: dict[str, int]) -> set[tuple[str, int]]:
    return simulated(writes, held, budgets)[0]


def simulated(
    writes: list[tuple[str, int]], held: int | None, budgets: dict[str, int]
) -> tuple[set[tuple[str, int]], Counter[str]]:
    """The rule, on chunk counts: after each write, a tenant over its budget (in chunks) loses
    its oldest; while more than `held` chunks are kept, the tenant with most chunks (ties:
    the first by name) loses its oldest; the chunk just written is never taken. The chunks
    kept, and those evicted per tenant."""
    kept: list[tuple[str, int]] = []
    evicted: Counter[str] = Counter()

    def evict(tenant: str, written: tuple[str, int]) -> None:
        kept.remove(next(item for item in kept if item[0] == tenant and item != written))
        evicted[tenant] += 1

    for written in writes:
        if written in kept:
            kept.remove(written)
        kept.append(written)
        tenant = written[0]
        while tenant in budgets and sum(t == tenant for t, _ in kept) > budgets[tenant]:
            evict(tenant, written)
        while held is not None and len(kept) > held:
            counts = Counter(t for t, _ in kept)
            candidates = sorted((t for t in counts if any(i[0] == t and i != written for i in kept)),
                                key=lambda t: (-counts[t], t))  # fmt: skip
            evict(candidates[0], written)
    return set(kept), evicted


def survivors(store: LMDBStore) -> set[tuple[str, int]]:
    names = {key(t, i).to_bytes(): (t, i) for t in ("a", "b", "c", "") for i in range(400)}
    return {names[k.to_bytes()] for k in store.iter_keys()}


def scanned(store: LMDBStore) -> dict[str, int]:
    totals: dict[str, int] = {}
    for stored in store.iter_keys():
        totals[stored.tenant] = totals.get(stored.tenant, 0) + store.blob_size(stored)
    return totals


def sequence(seed: int, tenants: list[str], weights: list[int], length: int) -> list[tuple[str, int]]:
    """Writes in bursts, each chunk new (a passage pasted once) or, now and then, rewritten."""
    rng = random.Random(seed)
    writes: list[tuple[str, int]] = []
    for _ in range(length):
        tenant = rng.choices(tenants, weights)[0]
        mine = [w for w in writes if w[0] == tenant]
        writes.append(rng.choice(mine) if mine and rng.random() < 0.15 else (tenant, len(writes)))
    return writes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_full_store_evicts_the_tenant_most_above_its_fair_share(tmp_path, seed) -> None:
    geometry = chunk_geometry(tmp_path)
    writes = sequence(seed, ["a", "b"], [3, 1], 60)  # a floods at three times b's rate
    with capped(tmp_path / "kv", geometry) as store:
        for tenant, i in writes:
            store.put(key(tenant, i), blob())
        assert survivors(store) == reference(writes, HELD, {})
        # b keeps every chunk while it holds less than half: a's flood never took one
        assert sum(t == "b" for t, _ in survivors(store)) == min(HELD // 2, len({w for w in writes if w[0] == "b"}))


def test_three_tenants_and_shared_chunks_share_the_capacity(tmp_path) -> None:
    geometry = chunk_geometry(tmp_path)
    writes = sequence(7, ["a", "b", "c", ""], [6, 2, 1, 1], 90)
    with capped(tmp_path / "kv", geometry) as store:
        for tenant, i in writes:
            store.put(key(tenant, i), blob())
        assert survivors(store) == reference(writes, HELD, {})
        assert store.tenant_bytes() == scanned(store)


def test_a_lone_tenant_uses_the_whole_capacity(tmp_path) -> None:
    geometry = chunk_geometry(tmp_path)
    writes = [("a", i) for i in range(25)]
    with capped(tmp_path / "kv", geometry) as store:
        for tenant, i in writes:
            store.put(key(tenant, i), blob())
        assert survivors(store) == reference(writes, HELD, {}) == {("a", i) for i in range(15, 25)}


@pytest.mark.parametrize("held", [None, HELD])
def test_a_tenant_over_its_budget_evicts_its_own_chunks_first(tmp_path, held) -> None:
    geometry = chunk_geometry(tmp_path)
    size = geometry[1]
    writes = sequence(3, ["a", "b", "c"], [5, 1, 1], 60)
    with capped(tmp_path / "kv", geometry, held) as store:
        store.set_tenant_budgets(TenantBudgets(tenants={"a": 3 * size + size // 2}))
        for tenant, i in writes:
            store.put(key(tenant, i), blob())
        assert survivors(store) == reference(writes, held, {"a": 3})
        assert store.tenant_bytes()["a"] <= 3 * size + size // 2


def test_the_default_budget_bounds_every_tenant_and_a_tenants_own_replaces_it(tmp_path) -> None:
    geometry = chunk_geometry(tmp_path)
    size = geometry[1]
    writes = sequence(5, ["a", "b", ""], [2, 2, 1], 50)
    with capped(tmp_path / "kv", geometry, None) as store:
        store.set_tenant_budgets(TenantBudgets(default=2 * size, tenants={"b": 5 * size}))
        for tenant, i in writes:
            store.put(key(tenant, i), blob())
        assert survivors(store) == reference(writes, None, {"a": 2, "b": 5, "": 2})


def test_counts_and_order_hold_across_a_restart(tmp_path) -> None:
    geometry = chunk_geometry(tmp_path)
    writes = sequence(11, ["a", "b", "c"], [4, 2, 1], 80)
    with capped(tmp_path / "kv", geometry) as store:
        for tenant, i in writes[:40]:
            store.put(key(tenant, i), blob())
        counted = store.tenant_bytes()
    with capped(tmp_path / "kv", geometry) as reopened:
        assert reopened.tenant_bytes() == counted == scanned(reopened)
        for tenant, i in writes[40:]:
            reopened.put(key(tenant, i), blob())
        assert survivors(reopened) == reference(writes, HELD, {})
        assert reopened.tenant_bytes() == scanned(reopened) == reopened.recount()


def test_a_store_written_without_the_tenant_order_builds_it_when_opened(tmp_path) -> None:
    geometry = chunk_geometry(tmp_path)
    writes = sequence(13, ["a", "b"], [3, 1], 50)
    with capped(tmp_path / "kv", geometry) as store:
        for tenant, i in writes[:20]:
            store.put(key(tenant, i), blob())
        env = store._env

        def forget_order(txn) -> None:
            txn.drop(env.db(TENANT_LRU_DB), delete=False)
            txn.delete(b"tenant_order", db=env.db(SEGMENT_DB))

        env.write(forget_order)
    with capped(tmp_path / "kv", geometry) as reopened:
        for tenant, i in writes[20:]:
            reopened.put(key(tenant, i), blob())
        assert survivors(reopened) == reference(writes, HELD, {})


def test_per_tenant_evictions_are_counted_in_the_stats(tmp_path) -> None:
    geometry = chunk_geometry(tmp_path)
    writes = [("a", i) for i in range(12)] + [("b", 100 + i) for i in range(6)]
    with capped(tmp_path / "kv", geometry) as store:
        for tenant, i in writes:
            store.put(key(tenant, i), blob())
        kept = reference(writes, HELD, {})
        assert survivors(store) == kept
        store.get_many([key("a", i) for i in range(12)] + [key("b", 999)])
        stats = store.stats()
        a, b = stats.tenant("a"), stats.tenant("b")
        held = Counter(t for t, _ in kept)
        assert (a.evictions, b.evictions) == (12 - held["a"], 6 - held["b"]) == (7, 1)
        assert (a.hits, a.misses, b.hits, b.misses) == (held["a"], a.evictions, 0, 1)
        assert (a.bytes, b.bytes) == (held["a"] * geometry[1], held["b"] * geometry[1])


@pytest.mark.parametrize(
    "bad",
    [dict(default=0), dict(default=-5), dict(default=True), dict(default=1.5), dict(tenants={"a": 0}),
     dict(tenants={"no/slash": 10}), dict(tenants={"a": "10"})],
)  # fmt: skip
def test_bad_budgets_are_refused(bad) -> None:
    with pytest.raises((ValueError, TypeError)):
        TenantBudgets(**bad)


def test_fair_share_order_is_by_bytes_then_name() -> None:
    assert fair_share_order({"b": 5, "a": 5, "c": 9, "d": 0}) == ["c", "a", "b"]


def test_a_tiered_store_keeps_budgets_in_its_lmdb_tier_and_sums_its_evictions(tmp_path) -> None:
    geometry = chunk_geometry(tmp_path)
    writes = sequence(17, ["a", "b"], [3, 1], 40)
    tiered = TieredStore([capped(tmp_path / "kv", geometry)], lru_bytes=1 << 20)
    with tiered:
        tiered.set_tenant_budgets(TenantBudgets(tenants={"b": 2 * geometry[1]}))
        for tenant, i in writes:
            tiered.put(key(tenant, i), blob())
        kept, evicted = simulated(writes, HELD, {"b": 2})
        assert survivors(tiered.tiers[0]) == kept
        tiered.get_many([key(t, i) for t, i in sorted(kept)])
        stats = tiered.stats()
        for tenant in ("a", "b"):
            figures = stats.tenant(tenant)
            assert figures.evictions == stats.tiers[0].tenant(tenant).evictions == evicted[tenant] > 0
            assert (figures.hits, figures.misses) == (sum(t == tenant for t, _ in kept), 0)
            assert figures.bytes == scanned(tiered.tiers[0])[tenant]


def redis_sized(url: str) -> int:
    """Blob bytes of one chunk in a Redis store."""
    with RedisStore(url) as probe:
        probe.put(key("probe", 0), blob())
        size = probe.blob_size(key("probe", 0))
        probe.delete(key("probe", 0))
    return size


@pytest.fixture
def redis_store(redis_url) -> RedisStore:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    with RedisStore(redis_url) as store:
        yield store


@pytest.mark.redis
def test_a_redis_tenant_over_its_budget_evicts_its_own_chunks_in_the_write_script(redis_store, redis_url) -> None:
    size = redis_sized(redis_url)
    budgets = {"a": 3, "": 2}
    redis_store.set_tenant_budgets(TenantBudgets(tenants={t: n * size + size // 2 for t, n in budgets.items()}))
    writes = sequence(23, ["a", "b", ""], [4, 1, 2], 60)
    for tenant, i in writes[:30]:
        redis_store.put(key(tenant, i), blob())
    with RedisStore(redis_url) as reopened:  # the order lives in Redis: another process goes on
        reopened.set_tenant_budgets(redis_store.tenant_budgets)
        for tenant, i in writes[30:]:
            reopened.put(key(tenant, i), blob())
        kept, evicted = simulated(writes, None, budgets)
        assert survivors(reopened) == kept
        assert (
            reopened.tenant_bytes()
            == scanned(reopened)
            == {t: n * size for t, n in Counter(t for t, _ in kept).items()}
        )
        counted = {t: redis_store.stats().tenant(t).evictions + reopened.stats().tenant(t).evictions for t in budgets}
        assert counted == {t: evicted[t] for t in budgets} and "b" not in evicted
        assert reopened.stats().entries == len(kept)  # the orders and sizes are no entries
        assert reopened.recount() == scanned(reopened)


@pytest.mark.redis
def test_a_redis_read_moves_a_chunk_up_its_tenants_order(redis_store, redis_url) -> None:
    size = redis_sized(redis_url)
    redis_store.set_tenant_budgets(TenantBudgets(default=3 * size))
    for i in range(3):
        redis_store.put(key("a", i), blob())
    assert redis_store.get(key("a", 0)) is not None  # 0 is now the most recently used
    redis_store.put(key("a", 3), blob())
    redis_store.recount()  # a recount keeps each chunk's last use
    redis_store.put(key("a", 4), blob())
    assert survivors(redis_store) == {("a", 0), ("a", 3), ("a", 4)}


@pytest.mark.redis
def test_a_redis_cluster_refuses_budgets(redis_cluster_url) -> None:
    with RedisStore(redis_cluster_url) as store:
        assert not store.keeps_tenant_budgets
        with pytest.raises(ValueError, match="no per-tenant budgets"):
            store.set_tenant_budgets(TenantBudgets(default=10))
        store.set_tenant_budgets(TenantBudgets())  # none asked: nothing to refuse
