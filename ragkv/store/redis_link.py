"""A Redis connection that fails fast and backs off: what every Redis user in ragkv shares
(chunk tier, sessions). Redis is a cache or a shared tier that may vanish; a request must
never hang on it, so there are no retries and, after a connection failure, calls are
skipped for `retry_after_s` instead of timing out one by one.

The URL names a single server or a Redis Cluster (store.redis_client); with a cluster,
`healthy()` asks every master, since losing one loses its slots' keys."""

from __future__ import annotations

import time

from redis.cluster import RedisCluster

from ragkv.store.redis_client import ERRORS, is_cluster_url, redis_client


class RedisLink:
    def __init__(self, url: str, *, connect_timeout_s: float, op_timeout_s: float, retry_after_s: float):
        self.cluster = is_cluster_url(url)
        self.client = redis_client(url, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s)
        self._retry_after_s = retry_after_s
        self._down_until = 0.0

    def healthy(self) -> bool:
        """PING the server (every master of a cluster) now, ignoring any back-off; True if
        it answered (ends the back-off)."""
        try:
            if self.cluster:
                self.client.ping(target_nodes=RedisCluster.PRIMARIES)
            else:
                self.client.ping()
        except ERRORS:
            return False
        self._down_until = 0.0
        return True

    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._down_until

    def mark_down(self) -> None:
        self._down_until = time.monotonic() + self._retry_after_s
