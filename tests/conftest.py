"""Shared fixtures: a real redis-server for the store tests (no mocks).

Triton kernels run in its CPU interpreter in this process (tests compare them with the
torch references). The variable must be set before anything imports triton: triton
decides when its own library functions (`tl.zeros`, ...) are defined whether they are
interpreted, and a test module collected earlier may import it indirectly.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from redis_server import RedisServer  # noqa: E402  pytest puts tests/ on sys.path (no tests/__init__.py)


def _started_server(appendonly: bool = False) -> RedisServer:
    try:
        server = RedisServer(appendonly=appendonly)
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a redis-server shared by the whole session.  Never kill it; tests
    that need a clean database flush it themselves."""
    server = _started_server()
    yield server.url
    server.cleanup()


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """redis+cluster:// URL of a three-master Redis Cluster shared by the whole session (never
    kill it; tests flush it themselves). Tests that kill a master start their own."""
    from redis_cluster import RedisClusterServers

    try:
        cluster = RedisClusterServers()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    cluster.start()
    yield cluster.url
    cluster.cleanup()


@pytest.fixture
def killable_redis() -> Iterator[RedisServer]:
    """A private redis-server for this test, which it may ``stop()`` and ``start()`` again."""
    server = _started_server()
    yield server
    server.cleanup()


@pytest.fixture
def durable_redis() -> Iterator[RedisServer]:
    """Like `killable_redis`, with the append-only file on: a restart keeps what was written."""
    server = _started_server(appendonly=True)
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def engine():
    """The packaged SmolLM2-135M engine (dequantised once into the cache, then ~4 s), in the
    float32 reference numerics so exactness tests compare like with like; the fast formats
    are checked against it in tests/test_numerics.py."""
    from ragkv.engine import Engine, EngineConfig

    return Engine(EngineConfig(weights="float32", prefill_weights="float32", kv_cache_dtype="float32"))
