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
from ragkv.store.redis_tenants import DELETE, PUT, counter_key, counter_keys

_SCHEMES = SCHEMES
_DOWN = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException)
"""Errors that mean the server (or a cluster master) is unreachable: start backing off."""
_SCAN_BATCH = 1000


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
        super().__init__(mac_key=mac_key)

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
            return self._client.mget(keys)

    def _put_raw_many(self, pairs: list[tuple[bytes, RawBlob]]) -> None:
        with self._call():
            pipe = self._client.pipeline(transaction=False)
            expiry = b"" if self._ttl_ms is None else b"%d" % self._ttl_ms
            for key, blob in pairs:
                # redis-py sends memoryviews as-is (no copy) but rejects bytearray.
                # EVAL by name: a cluster pipeline has no eval() but routes EVAL by its keys' slot.
                pipe.execute_command("EVAL", PUT, 2, key, self._counter(key), tenant_of(key), memoryview(blob), expiry)
            pipe.execute()

    def _delete_raw(self, key: bytes) -> bool:
        with self._call():
            return bool(self._client.eval(DELETE, 2, key, self._counter(key), tenant_of(key)))

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
        """Rebuild the counters from a full scan of the blobs; returns them. Writes made
        during the scan may be counted twice or not at all: run it while writes are quiet."""
        self._check_open()
        with self._call():
            per_counter: dict[bytes, dict[str, int]] = {}
            for key in self._client.scan_iter(match=_glob_escape(KEY_NAMESPACE) + b"*", count=_SCAN_BATCH):
                size = self._client.strlen(key)
                fields = per_counter.setdefault(self._counter(key), {})
                fields[tenant_of(key)] = fields.get(tenant_of(key), 0) + size
            pipe = self._client.pipeline(transaction=False)
            for counter in counter_keys(self._link.cluster):
                pipe.delete(counter)
            for counter, fields in per_counter.items():
                pipe.hset(counter, mapping={t: n for t, n in fields.items() if n})
            pipe.execute()
        return self._read_counters()

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
        """How many counter hashes exist (DBSIZE counts them beside the blobs)."""
        pipe = self._client.pipeline(transaction=False)
        for key in counter_keys(self._link.cluster):
            pipe.exists(key)
        return sum(pipe.execute())

    def _iter_raw_keys(self, prefix: bytes) -> Iterator[bytes]:
        # SCAN may list a key twice; acceptable for garbage collection.
        with self._call():
            yield from self._client.scan_iter(match=_glob_escape(prefix) + b"*", count=_SCAN_BATCH)

    def _close(self) -> None:
        self._client.close()
