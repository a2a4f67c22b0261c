"""The store benchmark runs on real backends and returns JSON-ready results."""

from __future__ import annotations

import json

import pytest
import redis
import torch

from ragkv.bench.store_bench import run_store_bench
from ragkv.store import LMDBStore, RedisStore, TieredStore


@pytest.mark.redis
def test_bench_reports_every_backend_and_the_file_baseline(tmp_path, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    stores = {
        "lmdb": LMDBStore(tmp_path / "kv"),
        "redis": RedisStore(redis_url),
        "tiered": TieredStore([LMDBStore(tmp_path / "kv2")], lru_bytes=1 << 20),
    }
    try:
        result = run_store_bench(
            stores,
            chunks=6,
            tokens_per_chunk=16,
            layers=2,
            kv_heads=2,
            head_dim=8,
            dtype=torch.bfloat16,
            tmp_dir=tmp_path,
            batch_size=4,
        )
        json.dumps(result)
        assert result["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 2
        assert set(result["backends"]) == {"lmdb", "redis", "tiered", "raw_file"}
        for name, figures in result["backends"].items():
            assert figures["verified"] and figures["misses"] == 0, name
            assert figures["write_mb_s"] > 0 and figures["read_warm_chunks_s"] > 0
        assert stores["lmdb"].stats().entries == 0  # benchmark keys cleaned up
        assert list(tmp_path.glob("raw_file_bench_*")) == []
    finally:
        for store in stores.values():
            store.close()


def test_bench_validates_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="chunks"):
        run_store_bench({}, chunks=0, tokens_per_chunk=1, layers=1, kv_heads=1, head_dim=1, tmp_dir=tmp_path)
    with LMDBStore(tmp_path / "kv") as store, pytest.raises(ValueError, match="reserved"):
        run_store_bench(
            {"raw_file": store}, chunks=1, tokens_per_chunk=1, layers=1, kv_heads=1, head_dim=1, tmp_dir=tmp_path
        )
