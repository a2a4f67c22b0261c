"""The sustained passages bench's decay statistic: the slope of the per-query span hit rate."""

from __future__ import annotations

import random

import pytest

from ragkv.bench.passages_bench import hit_rate_trend


def _rows(rate_at, queries=400, spans=8, seed=0):
    rng = random.Random(seed)
    return [
        {"query": q, "spans": spans, "hits": sum(rng.random() < rate_at(q) for _ in range(spans))}
        for q in range(101, 101 + queries)
    ]


def test_a_steady_hit_rate_has_no_trend_beyond_its_error():
    trend = hit_rate_trend(_rows(lambda q: 0.25))
    assert abs(trend["slope_per_100"]) < 2.5 * trend["stderr_per_100"]
    assert 0.0 < trend["stderr_per_100"] < 0.02 and trend["queries"] == 400


def test_a_decaying_hit_rate_shows_as_a_negative_slope():
    # the LMCache #4663 shape: 0.5 at query 101 falling to 0.1 at query 500
    trend = hit_rate_trend(_rows(lambda q: 0.5 - 0.4 * (q - 101) / 400))
    assert trend["slope_per_100"] == pytest.approx(-0.1, abs=0.02)
    assert trend["slope_per_100"] < -5 * trend["stderr_per_100"]


def test_too_few_queries_give_no_slope():
    assert hit_rate_trend(_rows(lambda q: 0.25, queries=2))["stderr_per_100"] == float("inf")
