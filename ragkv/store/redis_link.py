"""A Redis connection that fails fast and backs off: what every Redis user in ragkv shares
(chunk tier, sessions). Redis is a cache or a shared tier that may vanish; a request must
never hang on it, so there are no retries and, after a connection failure, calls are
skipped for `retry_after_s` instead of timing out one by one."""

from __future__ import annotations

import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


class RedisLink:
    def __init__(self, url: str, *, connect_timeout_s: float, op_timeout_s: float, retry_after_s: float):
        self.client = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=op_timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self._retry_after_s = retry_after_s
        self._down_until = 0.0

    def healthy(self) -> bool:
        """PING the server now (ignoring any back-off); True if it answered (ends the back-off)."""
        try:
            self.client.ping()
        except redis.RedisError:
            return False
        self._down_until = 0.0
        return True

    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._down_until

    def mark_down(self) -> None:
        self._down_until = time.monotonic() + self._retry_after_s
