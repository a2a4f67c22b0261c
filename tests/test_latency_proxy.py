"""The benchmarks' Redis latency proxy: a real redis-server behind it answers byte for byte,
each reply at least the asked delay late, and stopping it closes its connections."""

from __future__ import annotations

import time

import pytest
import redis

from ragkv.bench.arrivals_bench import ArrivalsConfig
from ragkv.bench.latency_proxy import LatencyProxy
from ragkv.bench.redis_process import RedisServer


@pytest.fixture
def server():
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


def test_replies_pass_unchanged_and_no_sooner_than_the_delay(server):
    proxy = LatencyProxy(server.port, 0.02).start()
    try:
        client = redis.Redis.from_url(proxy.url)
        blob = bytes(range(256)) * 12_000  # several reads of the proxy's buffer
        client.set("blob", blob)
        started = time.perf_counter()
        assert client.get("blob") == blob
        assert client.get("missing") is None
        # a lower bound only: two round trips each wait the delay at least, however loaded the machine
        assert time.perf_counter() - started >= 0.04
        client.close()
    finally:
        proxy.stop()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(proxy.url, socket_connect_timeout=1).ping()


def test_a_negative_delay_is_refused(server):
    with pytest.raises(ValueError, match="delay_s"):
        LatencyProxy(server.port, -1.0)


@pytest.mark.parametrize(
    "changes, message",
    [({"clients": 0}, "clients"), ({"interval_s": 0}, "interval_s"), ({"max_tokens": 1}, "max_tokens")],
)
def test_the_benchmark_refuses_settings_it_cannot_measure(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        ArrivalsConfig(dataset=tmp_path / "d.json", **changes)
