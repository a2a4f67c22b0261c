"""Each tenant's chunk bytes in Redis, counted by the Lua scripts that write and delete chunks.

A script runs atomically on the server, so a blob and its tenant's counter change together
or not at all, whichever replica writes. The counters are hash fields (tenant -> bytes; the
field ``""`` counts shared chunks). On a single server they live in one hash; in a Redis
Cluster a script may only touch keys of one slot, so each slot has its own hash, named with
a hash tag that lands in that slot, and a tenant's bytes are the sum over the slots.

Redis drops blobs on its own when ``ttl_s`` expires them or ``maxmemory`` evicts them;
the counters cannot see that, so they are an upper bound there until :meth:`recount`.

On a single server each tenant also has a use order (a sorted set of its chunk keys by last
write or read) and the sizes it counted (a hash), and the write script keeps a tenant's
budget: past it, the tenant's least recently used chunks are deleted in the same script,
never another tenant's (a blob Redis dropped on its own leaves the count with its counted
size). A cluster cannot: a script touches one slot, and a tenant's chunks span them all.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

COUNTER_KEY = b"ragkv/tenant-bytes"
ORDER_PREFIX = b"ragkv/tenant-order/"
SIZES_PREFIX = b"ragkv/tenant-sizes/"

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


PUT_BOUNDED = """
local counted = redis.call('HGET', KEYS[4], KEYS[1])
local old = counted and tonumber(counted) or redis.call('STRLEN', KEYS[1])
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
local size = string.len(ARGV[2])
local held = redis.call('HINCRBY', KEYS[2], ARGV[1], size - old)
redis.call('ZADD', KEYS[3], ARGV[4], KEYS[1])
redis.call('HSET', KEYS[4], KEYS[1], size)
local evicted = 0
if ARGV[5] ~= '' then
  local budget = tonumber(ARGV[5])
  while held > budget do
    local oldest = redis.call('ZRANGE', KEYS[3], 0, 1)
    local victim = oldest[1]
    if victim == KEYS[1] then victim = oldest[2] end
    if not victim then break end
    local victim_size = tonumber(redis.call('HGET', KEYS[4], victim) or '0')
    evicted = evicted + redis.call('DEL', victim)
    redis.call('ZREM', KEYS[3], victim)
    redis.call('HDEL', KEYS[4], victim)
    held = redis.call('HINCRBY', KEYS[2], ARGV[1], -victim_size)
  end
end
if held <= 0 then redis.call('HDEL', KEYS[2], ARGV[1]) end
return evicted
"""
"""A single server's write: KEYS: chunk, counter hash, the tenant's order and sizes; ARGV:
tenant, blob, expiry in ms or '', the use stamp, the tenant's budget in bytes or ''.
Returns how many of the tenant's chunks it evicted."""

DELETE_BOUNDED = """
local existed = redis.call('EXISTS', KEYS[1])
local counted = redis.call('HGET', KEYS[4], KEYS[1])
if existed == 0 and not counted then return 0 end
local old = counted and tonumber(counted) or redis.call('STRLEN', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[3], KEYS[1])
redis.call('HDEL', KEYS[4], KEYS[1])
if old > 0 and redis.call('HINCRBY', KEYS[2], ARGV[1], -old) <= 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
end
return existed
"""
"""A single server's delete: KEYS and ARGV[1] as PUT_BOUNDED's."""


def order_key(tenant: str) -> bytes:
    """The tenant's use order on a single server (chunk key -> stamp of its last use)."""
    return ORDER_PREFIX + tenant.encode("ascii")


def sizes_key(tenant: str) -> bytes:
    """The sizes a single server counted for the tenant's chunks (chunk key -> bytes)."""
    return SIZES_PREFIX + tenant.encode("ascii")


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
