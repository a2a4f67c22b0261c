"""The sustained workload's draws and its store replay (bench.eviction_bench): a real capped
LMDB store, no model."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ragkv.bench.eviction_bench import Replay, replay_seed, run_eviction_replay
from ragkv.bench.passages_bench import PoolDraws

POOL = [" ".join(f"w{i}x{j}." for j in range(100 + i % 50)) for i in range(800)]


def words(text: str) -> int:
    return len(text.split())


def test_uniform_draws_are_those_of_runs_made_before_zipf_draws_existed():
    draws, reference = PoolDraws(POOL, seed=3), random.Random(3)
    for _ in range(20):
        pasted = draws.passages(draws.rng.randint(6, 10))
        assert pasted == [POOL[i] for i in reference.sample(range(len(POOL)), reference.randint(6, 10))]


def test_zipf_draws_favour_a_few_passages_and_one_off_blocks_are_never_repeated():
    zipf, uniform = Counter(), Counter()
    draws, flat = PoolDraws(POOL, seed=0, zipf=1.0, one_off=1), PoolDraws(POOL, seed=0)
    one_offs = set()
    for _ in range(300):
        pasted = draws.passages(8)
        assert len(pasted) == 9 and len(set(pasted)) == 9
        one_offs.update(p for p in pasted if p not in POOL)
        zipf.update(p for p in pasted if p in POOL)
        uniform.update(flat.passages(8))
    assert len(one_offs) == 300
    top = lambda counts: sum(n for _, n in counts.most_common(24)) / sum(counts.values())  # noqa: E731
    assert top(zipf) > 0.4 > 0.2 > top(uniform)


def test_a_replay_is_deterministic_and_segments_beat_lru_under_one_off_blocks():
    replay = Replay(queries=200, one_off_blocks=2)
    lru = replay_seed(POOL, words, replay, 0.0, seed=1)
    assert lru == replay_seed(POOL, words, replay, 0.0, seed=1)
    segmented = replay_seed(POOL, words, replay, 0.8, seed=1)
    hits = lambda rows: sum(r["hits"] for r in rows[100:])  # noqa: E731
    assert hits(segmented) > 1.1 * hits(lru)


def test_the_replay_reports_each_policy_over_the_seeds():
    results = run_eviction_replay(POOL, words, Replay(queries=200), [0.0, 0.8], [0, 1])
    for share in ("0.0", "0.8"):
        row = results["policies"][share]
        assert [r["seed"] for r in row["per_seed"]] == [0, 1]
        assert 0.1 < row["hit_rate_queries_101_200"] < 0.45  # a quarter of the pool, by bytes
        assert row["last_100_reaches_101_200"] in (0.0, 0.5, 1.0)


@pytest.mark.parametrize("bad", [dict(queries=100), dict(passages_per_query=(0, 3)), dict(capacity_share=0)])
def test_a_replay_checks_its_workload(bad):
    with pytest.raises(ValueError):
        Replay(**bad)


def test_a_popularity_shift_reranks_the_pool_at_its_query():
    before, after = Counter(), Counter()
    draws = PoolDraws(POOL, seed=0, zipf=1.2, shift_at=201)
    for number in range(1, 401):
        (before if number <= 200 else after).update(draws.passages(8))
    top = {p for p, _ in before.most_common(10)}
    assert sum(after[p] for p in top) < 0.25 * sum(before[p] for p in top)
