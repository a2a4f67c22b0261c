"""Each tenant's chunk bytes in Redis, counted by the Lua scripts that write and delete chunks.

A script runs atomically on the server, so a blob and its tenant's counter change together
or not at all, whichever replica writes. The counters are hash fields (tenant -> bytes; the
field ``""`` counts shared chunks). On a single server they live in one hash; in a Redis
Cluster a script may only touch keys of one slot, so each slot has its own hash, named with
a hash tag that lands in that slot, and a tenant's bytes are the sum over the slots.

Redis drops blobs on its own when ``ttl_s`` expires them or ``maxmemory`` evicts them;
the counters cannot see that, so they are an upper bound there until :meth:`recount`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

COUNTER_KEY = b"ragkv/tenant-bytes"

PUT = """
local old = redis.call('STRLEN', KEYS[1])
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
local delta = string.len(ARGV[2]) - old
if delta ~= 0 and redis.call('HINCRBY', KEYS[2], ARGV[1], delta) <= 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
end
return delta
"""
"""KEYS: chunk, counter hash; ARGV: tenant, blob, expiry in ms or ''."""

DELETE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local old = redis.call('STRLEN', KEYS[1])
redis.call('DEL', KEYS[1])
if old > 0 and redis.call('HINCRBY', KEYS[2], ARGV[1], -old) <= 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
end
return 1
"""
"""KEYS: chunk, counter hash; ARGV: tenant. An empty blob (corrupt) is deleted too."""


@functools.cache
def _slot_tags() -> tuple[bytes, ...]:
    """For each cluster slot, a short hash tag that Redis hashes into it."""
    tags: list[bytes | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    missing = REDIS_CLUSTER_HASH_SLOTS
    for number in itertools.count():
        tag = b"%x" % number
        slot = key_slot(tag)
        if tags[slot] is None:
            tags[slot] = tag
            missing -= 1
            if not missing:
                return tuple(tags)  # type: ignore[arg-type]
    raise AssertionError("unreachable")


def counter_key(chunk_key: bytes, cluster: bool) -> bytes:
    """The counter hash that the script writing `chunk_key` updates (same slot)."""
    if not cluster:
        return COUNTER_KEY
    return COUNTER_KEY + b"/{" + _slot_tags()[key_slot(chunk_key)] + b"}"


def counter_keys(cluster: bool) -> Iterator[bytes]:
    """Every counter hash there may be."""
    if not cluster:
        yield COUNTER_KEY
        return
    for tag in _slot_tags():
        yield COUNTER_KEY + b"/{" + tag + b"}"
