"""Shared chunk cache in Redis, for several serving replicas.

Redis is treated as a cache that may vanish at any moment: every Redis error
is a miss on read and a dropped write, counted in ``stats().errors`` and
logged once per outage (see :class:`store.base.ChunkStore`).  Timeouts are
short, redis-py's own retries are off, and after a connection failure the
store stops calling Redis for ``retry_after_s``, so a dead or unreachable
server costs a request at most one short timeout, not one per lookup.

Use a dedicated Redis database: ``stats().entries`` is its ``DBSIZE``.

With a Redis Cluster URL (``redis+cluster://host:port,host:port/``) the blobs spread over
the masters by key slot; a read of many chunks is one MGET per slot, and a master that
dies fails the reads and writes that touch it like a single server that dies (misses and
dropped writes, then the back-off). Use a dedicated cluster: ``entries`` sums every
master's ``DBSIZE`` (less the tenant counters).

Blobs are written and deleted by Lua scripts that also adjust their tenant's byte counter
(:mod:`store.redis_tenants`), so per-tenant bytes hold across restarts of ragkv and agree
with the blobs whichever replica wrote them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import redis
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException

from ragkv.store.base import BlobStore, RawBlob, StoreUsage
from ragkv.store.errors import StoreUnavailableError
from ragkv.store.keys import KEY_NAMESPACE, tenant_of
from ragkv.store.redis_client import SCHEMES, where
from ragkv.store.redis_link import RedisLink
from ragkv.store.redis_tenants import (
    COUNTER_KEY,
    DELETE,
    DELETE_BOUNDED,
    PUT,
    PUT_BOUNDED,
    counter_key,
    counter_keys,
    order_key,
    sizes_key,
)
from ragkv.store.tenant_budgets import TenantBudgets

_SCHEMES = SCHEMES
_DOWN = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException)
"""Errors that mean the server (or a cluster master) is unreachable: start backing off."""
_SCAN_BATCH = 1000


class _UseClock:
    """Microseconds since the epoch, strictly increasing within this process: the scores of
    a tenant's use order (a sorted set), so writes in the same millisecond keep their order
    instead of falling back to the members' byte order."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns() // 1000)
            return self._last


_use_clock = _UseClock()


def _check_positive(name: str, value: float | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds; got {value!r}")


def _glob_escape(prefix: bytes) -> bytes:
    for char in (b"\\", b"*", b"?", b"[", b"]"):
        prefix = prefix.replace(char, b"\\" + char)
    return prefix


class RedisStore(BlobStore):
    """Chunk store in the Redis server at ``url`` (``redis://host:port/db``), or in a Redis
    Cluster (``redis+cluster://host:port[,host:port...]/``).

    ``ttl_s`` expires entries that long after they were written (``None``:
    never; rely on Redis' ``maxmemory-policy`` instead).
    """

    backend = "redis"
    _transient_errors = (redis.RedisError, RedisClusterException, StoreUnavailableError)

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float | None = None,
        connect_timeout_s: float = 0.5,
        op_timeout_s: float = 1.0,
        retry_after_s: float = 1.0,
        mac_key: bytes | None = None,
    ) -> None:
        if not isinstance(url, str) or urlsplit(url).scheme not in _SCHEMES:
            shown = urlsplit(url).scheme + "://..." if isinstance(url, str) else repr(url)  # URLs may hold passwords
            raise ValueError(f"RedisStore needs a redis://, rediss://, unix:// or redis+cluster:// URL; got {shown}")
        _check_positive("ttl_s", ttl_s, optional=True)
        _check_positive("connect_timeout_s", connect_timeout_s)
        _check_positive("op_timeout_s", op_timeout_s)
        _check_positive("retry_after_s", retry_after_s)
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._where = where(url)
        self._link = RedisLink(
            url, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s, retry_after_s=retry_after_s
        )
        self._client = self._link.client
        self._budgets = TenantBudgets()
        super().__init__(mac_key=mac_key)

    @property
    def keeps_tenant_budgets(self) -> bool:  # type: ignore[override]
        """A single server keeps them; a cluster only counts (a script touches one slot)."""
        return not self._link.cluster

    @property
    def tenant_budgets(self) -> TenantBudgets:
        return self._budgets

    def set_tenant_budgets(self, budgets: TenantBudgets) -> None:
        if not self.keeps_tenant_budgets:
            super().set_tenant_budgets(budgets)
        self._budgets = budgets

    def __repr__(self) -> str:
        return f"RedisStore({self._where!r})"  # never the URL: it may hold a password

    def healthy(self) -> bool:
        """PING the server now (ignoring any back-off); ``True`` if it answered."""
        return self._link.healthy()

    @contextmanager
    def _call(self) -> Iterator[None]:
        """Fail fast while backing off; start backing off on a connection failure."""
        if not self._link.available():
            raise StoreUnavailableError(f"redis at {self._where} is down; not retried yet")
        try:
            yield
        except _DOWN:
            self._link.mark_down()
            raise

    def _get_raw_many(self, keys: list[bytes]) -> list[RawBlob | None]:
        with self._call():
            if self._link.cluster:  # one MGET per slot: a cluster refuses keys of several slots in one
                return self._client.mget_nonatomic(keys)
            if not self._budgets.any:
                return self._client.mget(keys)
            pipe = self._client.pipeline(transaction=False)
            pipe.mget(keys)
            stamp = _use_clock()
            for tenant in {tenant_of(key) for key in keys}:  # the reads move the chunks up their tenant's order
                pipe.zadd(order_key(tenant), {key: stamp for key in keys if tenant_of(key) == tenant}, xx=True)
            return pipe.execute()[0]

    def _put_raw_many(self, pairs: list[tuple[bytes, RawBlob]]) -> None:
        with self._call():
            pipe = self._client.pipeline(transaction=False)
            expiry = b"" if self._ttl_ms is None else b"%d" % self._ttl_ms
            for key, blob in pairs:
                # redis-py sends memoryviews as-is (no copy) but rejects bytearray.
                # EVAL by name: a cluster pipeline has no eval() but routes EVAL by its keys' slot.
                tenant = tenant_of(key)
                if self._link.cluster:
                    pipe.execute_command("EVAL", PUT, 2, key, self._counter(key), tenant, memoryview(blob), expiry)
                else:
                    budget = self._budgets.of(tenant)
                    keys = (key, self._counter(key), order_key(tenant), sizes_key(tenant))
                    stamp = b"%d" % _use_clock()
                    args = (tenant, memoryview(blob), expiry, stamp, b"" if budget is None else b"%d" % budget)
                    pipe.execute_command("EVAL", PUT_BOUNDED, 4, *keys, *args)
            results = pipe.execute()
            if not self._link.cluster:
                self._count_tenant_evictions(Counter({tenant_of(key): n for (key, _), n in zip(pairs, results) if n}))

    def _delete_raw(self, key: bytes) -> bool:
        with self._call():
            tenant = tenant_of(key)
            if self._link.cluster:
                return bool(self._client.eval(DELETE, 2, key, self._counter(key), tenant))
            keys = (key, self._counter(key), order_key(tenant), sizes_key(tenant))
            return bool(self._client.eval(DELETE_BOUNDED, 4, *keys, tenant))

    def _counter(self, key: bytes) -> bytes:
        return counter_key(key, self._link.cluster)

    def tenant_bytes(self) -> dict[str, int] | None:
        """Blob bytes per tenant, as the write scripts counted them (``""``: shared chunks);
        ``None`` while Redis is unreachable."""
        self._check_open()
        return self._attempt("tenant bytes", self._read_counters, fallback=None)

    def _tenant_bytes_of_stats(self) -> dict[str, int] | None:
        # A cluster keeps a counter hash per slot: too many reads for every stats call.
        return None if self._link.cluster else self.tenant_bytes()

    def _read_counters(self) -> dict[str, int]:
        with self._call():
            pipe = self._client.pipeline(transaction=False)
            for key in counter_keys(self._link.cluster):
                pipe.hgetall(key)
            totals: dict[str, int] = {}
            for fields in pipe.execute():
                for tenant, size in fields.items():
                    name = tenant.decode("ascii")
                    totals[name] = totals.get(name, 0) + int(size)
            return {tenant: size for tenant, size in totals.items() if size > 0}

    def recount(self) -> dict[str, int]:
        """Rebuild the counters (and a single server's use orders and sizes) from a full
        scan of the blobs; returns them. Writes made during the scan may be counted twice or
        not at all: run it while writes are quiet."""
        self._check_open()
        with self._call():
            per_counter: dict[bytes, dict[str, int]] = {}
            sizes: dict[bytes, int] = {}
            for key in self._client.scan_iter(match=_glob_escape(KEY_NAMESPACE) + b"*", count=_SCAN_BATCH):
                sizes[key] = size = self._client.strlen(key)
                fields = per_counter.setdefault(self._counter(key), {})
                fields[tenant_of(key)] = fields.get(tenant_of(key), 0) + size
            if not self._link.cluster:
                self._rebuild_orders(sizes)
            pipe = self._client.pipeline(transaction=False)
            for counter in counter_keys(self._link.cluster):
                pipe.delete(counter)
            for counter, fields in per_counter.items():
                pipe.hset(counter, mapping={t: n for t, n in fields.items() if n})
            pipe.execute()
        return self._read_counters()

    def _rebuild_orders(self, sizes: dict[bytes, int]) -> None:
        """Each tenant's use order and sizes from the scanned blobs (a chunk keeps its last
        use; one with none, written before orders were kept, goes first)."""
        tenants = set(self._read_counters()) | {tenant_of(key) for key in sizes}
        keys = list(sizes)
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.zscore(order_key(tenant_of(key)), key)
        stamps = pipe.execute() if keys else []
        pipe = self._client.pipeline(transaction=False)
        for tenant in tenants:
            pipe.delete(order_key(tenant), sizes_key(tenant))
        for key, stamp in zip(keys, stamps):
            if sizes[key]:
                pipe.zadd(order_key(tenant_of(key)), {key: stamp or 0})
                pipe.hset(sizes_key(tenant_of(key)), key, sizes[key])
        pipe.execute()

    def _contains_raw(self, key: bytes) -> bool:
        with self._call():
            return bool(self._client.exists(key))

    def _size_raw(self, key: bytes) -> int | None:
        with self._call():
            return self._client.strlen(key) or None  # 0: no such key (blobs are never empty)

    def _usage(self) -> StoreUsage:
        with self._call():
            if self._link.cluster:
                masters = RedisCluster.PRIMARIES
                memory = self._client.info("memory", target_nodes=masters)
                return StoreUsage(
                    entries=self._client.dbsize(target_nodes=masters) - self._counters_held(),
                    bytes=sum(info["used_memory"] for info in memory.values()),
                )
            entries = self._client.dbsize() - self._counters_held()
            return StoreUsage(entries=entries, bytes=self._client.info("memory")["used_memory"])

    def _counters_held(self) -> int:
        """How many counter hashes (and a single server's orders and sizes of the tenants
        counted) exist: DBSIZE counts them beside the blobs."""
        pipe = self._client.pipeline(transaction=False)
        for key in counter_keys(self._link.cluster):
            pipe.exists(key)
        held = sum(pipe.execute())
        if not self._link.cluster:
            tenants = self._client.hkeys(COUNTER_KEY)
            held += (
                self._client.exists(*[k for t in tenants for k in (order_key(t.decode()), sizes_key(t.decode()))])
                if tenants
                else 0
            )
        return held

    def _iter_raw_keys(self, prefix: bytes) -> Iterator[bytes]:
        # SCAN may list a key twice; acceptable for garbage collection.
        with self._call():
            yield from self._client.scan_iter(match=_glob_escape(prefix) + b"*", count=_SCAN_BATCH)

    def _close(self) -> None:
        self._client.close()
