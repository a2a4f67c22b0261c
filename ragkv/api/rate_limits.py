"""Limits per API key: requests per second and requests in progress, each answered with
429 and Retry-After past it (OpenAI's rate_limit_error shape).

The rate is counted by `limits` (moving windows, in this process's memory by default, or in
Redis with --rate-limit-storage redis://... so that replicas behind a router share one count
per key); requests in progress are counted here, per process: a request holds its slot until
its last byte is sent, streams included. A refused request counts against neither.

Limits come from the server's options (--max-requests-per-second, --max-concurrent-requests:
every key's) and from the keys file, where a key's own fields replace them:

    {"key-of-team-a": "team-a",
     "key-of-team-b": {"tenant": "team-b", "max_requests_per_second": 2, "max_concurrent_requests": 1}}

0 is unlimited. Without keys, every request counts against one shared allowance.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from fractions import Fraction

from limits import RateLimitItem, RateLimitItemPerSecond
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

from ragkv.api.errors import ApiError

_RATE_DENOMINATOR = 3600
"""A rate is counted as n requests per m seconds (m <= an hour): 0.5/s is 1 per 2 s."""


@dataclass(frozen=True)
class KeyLimits:
    """One API key's limits; 0 is unlimited."""

    max_requests_per_second: float = 0.0
    """Requests a key may start per second (a moving window; fractions: 0.5 is one per 2 s)."""
    max_concurrent_requests: int = 0
    """Requests a key may have in progress at once (streams until their last byte)."""

    def __post_init__(self) -> None:
        rps = self.max_requests_per_second
        if isinstance(rps, bool) or not (isinstance(rps, int | float) and rps >= 0):
            raise ValueError(f"max_requests_per_second must be a number >= 0, got {self.max_requests_per_second!r}")
        if 0 < rps < 1 / _RATE_DENOMINATOR:
            raise ValueError(f"max_requests_per_second must be 0 or at least one an hour (1/{_RATE_DENOMINATOR})")
        if isinstance(self.max_concurrent_requests, bool) or not (
            isinstance(self.max_concurrent_requests, int) and self.max_concurrent_requests >= 0
        ):
            raise ValueError(f"max_concurrent_requests must be an integer >= 0, got {self.max_concurrent_requests!r}")

    @classmethod
    def parse(cls, values: dict, base: KeyLimits, where: str) -> KeyLimits:
        """`base` with the fields `values` names replaced (ValueError naming `where`)."""
        names = {item.name for item in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        try:
            return replace(base, **values)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None


def rate_item(requests_per_second: float) -> RateLimitItem:
    """`requests_per_second` as n requests per m seconds."""
    rate = Fraction(requests_per_second).limit_denominator(_RATE_DENOMINATOR)
    return RateLimitItemPerSecond(rate.numerator, rate.denominator)


class KeyLimiter:
    """Admits a request of a key or answers why not (a 429 ApiError); `release` frees the
    slot of an admitted one."""

    def __init__(self, storage_uri: str = "memory://"):
        self._window = MovingWindowRateLimiter(storage_from_string(storage_uri))
        self._items: dict[float, RateLimitItem] = {}
        self._running: dict[str, int] = {}

    def admit(self, key_id: str, limits: KeyLimits) -> ApiError | None:
        running = self._running.get(key_id, 0)
        if limits.max_concurrent_requests and running >= limits.max_concurrent_requests:
            return ApiError(
                429,
                "concurrency_limit_exceeded",
                f"this API key has {running} requests in progress, the most it may have "
                f"(max_concurrent_requests {limits.max_concurrent_requests}); retry when one has finished",
                headers={"Retry-After": "1"},
            )
        rps = limits.max_requests_per_second
        if rps:
            item = self._items.get(rps) or self._items.setdefault(rps, rate_item(rps))
            if not self._window.hit(item, key_id):
                reset = self._window.get_window_stats(item, key_id).reset_time
                wait = max(1, math.ceil(reset - time.time()))
                return ApiError(
                    429,
                    "rate_limit_exceeded",
                    f"this API key may send {rps:g} requests per second (max_requests_per_second); "
                    f"retry after {wait} s",
                    headers={"Retry-After": str(wait)},
                )
        self._running[key_id] = running + 1
        return None

    def release(self, key_id: str) -> None:
        left = self._running.get(key_id, 0) - 1
        if left > 0:
            self._running[key_id] = left
        else:
            self._running.pop(key_id, None)
