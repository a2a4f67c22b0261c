"""`ragkv bench eviction`: the sustained passage workload replayed against the store alone.

The hit rates of `ragkv bench passages --sustained` depend only on which spans a query
pastes, their sizes and the store's eviction: the model decides none of it. So the same
draws (bench.passages_bench.PoolDraws) are replayed here against a real capped LMDB store,
each passage a blob sized by its tokens, looked up and the misses written back as
PromptPassages does, with no model run: many seeds in minutes. Per protected share (0 is
plain LRU) it reports the hit rate of queries 101-200 and of the last 100, how often the
second reaches the first, and the hit rate's trend from query 101. One model run per policy
(`bench passages --sustained`) checks that the replay's hit rates are the served ones.
"""

from __future__ import annotations

import functools
import hashlib
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ragkv.bench.passages_bench import PoolWorkload, hit_rate_trend, span_hit_rate
from ragkv.store.base import ChunkStore
from ragkv.store.keys import ChunkKey
from ragkv.store.url import open_store

BYTES_PER_TOKEN = 256
"""Blob bytes per passage token: sizes in proportion to real KV, small enough for many seeds."""
_MEMORY_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None  # no fsync per write: many seeds in minutes


@dataclass(frozen=True)
class Replay(PoolWorkload):
    """A sustained workload to replay, with as many questions as the served run draws from
    (their draw is part of the sequence) and the 200 queries its figures need."""

    questions: int = 100

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.queries < 200 or self.questions < 1:
            raise ValueError("need >= 200 queries (the figures compare queries 101-200) and >= 1 question")


def replay_seed(
    pool: list[str], tokens: Callable[[str], int], replay: Replay, protected_share: float, seed: int
) -> list[dict]:
    """Per query: spans pasted and spans the store held; `tokens(text)` counts a passage's tokens."""
    capacity = max(1, int(replay.capacity_share * pool_footprint(pool, tokens)))
    draws = replay.draws(pool, seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ragkv-eviction-", dir=_MEMORY_DIR) as folder:
        with open_store(f"lmdb://{folder}/store?capacity={capacity}&protected={protected_share}") as store:
            query(store, pool[:2], tokens)  # the served run's warm-up
            for number in range(1, replay.queries + 1):
                pasted, _ = draws.query(replay.passages_per_query, replay.questions)
                rows.append({"query": number, "spans": len(pasted), "hits": query(store, pasted, tokens)})
    return rows


@functools.lru_cache(maxsize=4)
def _footprint(pool: tuple[str, ...], tokens: Callable[[str], int]) -> int:
    with tempfile.TemporaryDirectory(prefix="ragkv-eviction-", dir=_MEMORY_DIR) as folder:
        with open_store(f"lmdb://{folder}/store") as store:
            query(store, list(pool), tokens)
            return store.stats().bytes


def pool_footprint(pool: list[str], tokens: Callable[[str], int]) -> int:
    """The bytes the whole pool takes in the store (pages, as the capacity counts them), so a
    capacity share keeps that share of the pool, as in the served run's large blobs."""
    return _footprint(tuple(pool), tokens)


def query(store: ChunkStore, pasted: list[str], tokens: Callable[[str], int]) -> int:
    """What PromptPassages does with the store for one prompt: look every passage up, write
    the misses back; how many it held."""
    keys = [ChunkKey("replay", hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), 1) for text in pasted]
    found = store.get_many(keys)
    missed = [(key, text) for key, text, tensors in zip(keys, pasted, found) if tensors is None]
    store.put_many([(key, {"kv": _blob(tokens(text))}) for key, text in missed])
    return len(keys) - len(missed)


@functools.cache
def _blob(tokens: int) -> torch.Tensor:
    return torch.from_numpy(np.zeros(tokens * BYTES_PER_TOKEN, dtype=np.uint8))  # no thread pool: cores are busy


def run_eviction_replay(
    pool: list[str],
    tokens: Callable[[str], int],
    replay: Replay,
    protected_shares: list[float],
    seeds: list[int],
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    policies = {}
    for share in protected_shares:
        runs = []
        for seed in seeds:
            rows = replay_seed(pool, tokens, replay, share, seed)
            middle, last, overall = span_hit_rate(rows[100:200]), span_hit_rate(rows[-100:]), span_hit_rate(rows)
            runs.append(
                {
                    "seed": seed,
                    "queries_101_200": middle,
                    "last_100": last,
                    "all": overall,
                    "per_50": [span_hit_rate(rows[i : i + 50]) for i in range(0, len(rows) - 49, 50)],
                    "trend": hit_rate_trend(rows[100:]),
                }
            )
        held = [r["last_100"] >= r["queries_101_200"] for r in runs]
        slopes = np.array([r["trend"]["slope_per_100"] for r in runs])
        policies[str(share)] = {
            "protected_share": share,
            "hit_rate_queries_101_200": statistics.fmean(r["queries_101_200"] for r in runs),
            "hit_rate_per_50": [statistics.fmean(window) for window in zip(*(r["per_50"] for r in runs))],
            "hit_rate_last_100": statistics.fmean(r["last_100"] for r in runs),
            "hit_rate_all": statistics.fmean(r["all"] for r in runs),
            "last_100_reaches_101_200": sum(held) / len(held),
            "trend_per_100_mean": float(slopes.mean()),
            "trend_per_100_stderr": float(slopes.std(ddof=1) / np.sqrt(len(slopes))) if len(slopes) > 1 else None,
            "per_seed": runs,
        }
        row = policies[str(share)]
        progress(
            f"protected {share}: hit rate 101-200 {row['hit_rate_queries_101_200']:.3f}, last 100 "
            f"{row['hit_rate_last_100']:.3f}; last >= 101-200 in "
            f"{row['last_100_reaches_101_200']:.0%} of {len(seeds)} seeds"
        )
    return {
        "pool_passages": len(pool),
        "queries": replay.queries,
        "passages_per_query": list(replay.passages_per_query),
        "capacity_share": replay.capacity_share,
        **replay.settings(),
        "seeds": seeds,
        "bytes_per_token": BYTES_PER_TOKEN,
        "policies": policies,
    }
