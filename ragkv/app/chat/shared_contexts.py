"""Anonymous chat contexts published to Redis, so that a follow-up finds its cached prefix
on whichever replica a load balancer sends it: an OpenAI client that resends the whole
history (no session id) finds it by prefix, and a client that names the id an answer gave
(with only the new message) continues it there as a session.

After a turn the replica snapshots the context's rows (in the cache's 16-bit dtype, or
float16 for a wider cache) and a background thread publishes them: the blob
(app.chat.context_blob, with the deployment's MAC when a store secret is set) under the
context's id and, for a context of at least `min_rows` rows, per full 16-token block of the
conversation, a key from the block's chained hash (rooted in tenant and model fingerprint,
as the in-process prefix index) to the context's id. A turn whose conversation this process
does not hold asks Redis for all its block keys in one MGET, takes the context of the
longest run found, and reuses its rows as it would a local one; a turn that names an id
this process does not hold reads the blob by id (`load`).

`offer` returns a future that is resolved once the snapshot is in Redis (True) or will not
be (False): the API holds a chat answer's last event until then (bounded), so a follow-up
sent the moment the answer ends, to any replica, finds the context. The model thread never
waits on Redis.

Each tenant has its own byte budget in Redis, kept by a Lua script as a least recently used
list (a hit renews a context); a tenant's keys share one hash tag, so the script runs on a
Redis Cluster too. Everything expires with the idle TTL of sessions. A full queue drops the
oldest snapshot, and a failed Redis call marks the link down like every other Redis user in
ragkv: the turn then works from this process's memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from ragkv.app.chat.context_blob import KV_CODES, compact_dtype, context_tensors, decode_context, encode_context_tensors
from ragkv.app.chat.contexts import BLOCK_TOKENS, Context, Match, block_hashes
from ragkv.app.chat.conversation import common_prefix
from ragkv.store.background import lower_this_thread
from ragkv.store.errors import CorruptBlobError
from ragkv.store.redis_client import ERRORS, hash_tag
from ragkv.store.redis_link import RedisLink

log = logging.getLogger("ragkv.app.chat.shared_contexts")

# KEYS: the tenant's LRU (zset id -> last use) and sizes (hash id -> bytes).
# ARGV: id, size, now, budget, blob key prefix. Adds the context, then drops the least
# recently used until the tenant is within its budget; returns how many were dropped.
_ACCOUNT = """
redis.call('zadd', KEYS[1], ARGV[3], ARGV[1])
redis.call('hset', KEYS[2], ARGV[1], ARGV[2])
local total = 0
for _, size in ipairs(redis.call('hvals', KEYS[2])) do total = total + tonumber(size) end
local dropped = 0
while total > tonumber(ARGV[4]) do
    local oldest = redis.call('zpopmin', KEYS[1])
    if #oldest == 0 then break end
    local size = tonumber(redis.call('hget', KEYS[2], oldest[1]) or '0')
    redis.call('hdel', KEYS[2], oldest[1])
    redis.call('del', ARGV[5] .. oldest[1])
    total = total - size
    dropped = dropped + 1
end
return dropped
"""


@dataclass(frozen=True)
class SharedContextConfig:
    budget_bytes: int
    """Bytes of context KV each tenant may keep in Redis."""
    ttl_s: float
    """Idle seconds after which a published context expires."""
    min_rows: int = 256
    """Contexts of fewer KV rows (documents and conversation) are published by id only (a
    client that names the id sends only its new message, so the rows cannot be recomputed),
    not by prefix: for a client that resends the whole history recomputing them costs less
    than a fetch."""
    min_gain: int = 256
    """A turn that holds a context of its own asks Redis only when more than this many of
    its tokens are not covered by it: a fetch moves every row of a context, so saving a few
    tokens of compute with it is a loss."""
    queue: int = 4
    """Snapshots waiting to be published; a full queue drops the oldest."""
    kv_codes: str = "16bit"
    """How the KV travels (app.chat.context_blob.KV_CODES): the cache's 16-bit dtype, or int8
    codes (about half the bytes)."""

    def __post_init__(self) -> None:
        if self.budget_bytes < 1 or self.ttl_s <= 0 or self.min_rows < 1 or self.min_gain < 0 or self.queue < 1:
            raise ValueError("budget_bytes >= 1, ttl_s > 0, min_rows >= 1, min_gain >= 0 and queue >= 1")
        if self.kv_codes not in KV_CODES:
            raise ValueError(f"kv_codes must be one of {KV_CODES}, got {self.kv_codes!r}")


@dataclass
class SharedContextStats:
    published: int = 0
    dropped: int = 0
    """Snapshots not published: the queue was full or Redis failed."""
    evicted: int = 0
    """Contexts the tenants' budgets pushed out of Redis."""
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    loaded: int = 0
    """Contexts continued here by the id another replica's answer named."""
    publish_seconds: float = 0.0
    """Time from a snapshot's queueing to its publication, summed (what an answer's last
    event waits for)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add to counters: the model thread and the publisher both count, and `+=` on an
        attribute is a read and a write another thread may come between."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, float]:
        """The counters, read together."""
        with self._lock:
            return {name: getattr(self, name) for name in self.__dataclass_fields__ if not name.startswith("_")}


@dataclass
class _Snapshot:
    """What a context publishes, copied on the turn's thread (a later turn may write its rows)."""

    tenant: str
    id: str
    fingerprint: str
    conversation_ids: list[int]
    tensors: dict
    meta: dict


@dataclass
class _Pending:
    context: _Snapshot
    published: Future[bool]
    queued: float

    def settle(self, published: bool) -> None:
        if not self.published.done():
            self.published.set_result(published)


class SharedContexts:
    def __init__(self, link: RedisLink, config: SharedContextConfig, *, mac_key: bytes | None, on_error):
        self._link = link
        self._client = link.client
        self.config = config
        self._mac_key = mac_key
        self._on_error = on_error  # (operation, error): the owner marks the link down and logs once
        self.stats = SharedContextStats()
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=config.queue)
        self._ttl_ms = max(1, int(config.ttl_s * 1000))
        self._thread = threading.Thread(target=self._publish_loop, name="ragkv-context-publisher", daemon=True)
        self._thread.start()

    def _prefix(self, tenant: str) -> str:
        return f"ragkv:context:{hash_tag(tenant)}:"

    # -- publishing (after a turn) ------------------------------------------------------

    def offer(self, context: Context) -> Future[bool] | None:
        """Queue a snapshot of `context` for publishing; the future says once it is in Redis
        (True) or will not be (False). None: not published at all (a session, or Redis is
        down). Runs on the turn's thread: the copy is taken now, since a later turn on this
        replica may write into the context's rows."""
        if context.explicit or not self._link.available():
            return None
        tensors, meta = context_tensors(
            context, kv_dtype=compact_dtype(context.cache.dtype), kv_codes=self.config.kv_codes
        )
        snapshot = _Snapshot(
            context.tenant, context.id, context.fingerprint, list(context.conversation_ids), tensors, meta
        )
        published: Future[bool] = Future()
        item = _Pending(snapshot, published, time.perf_counter())
        while True:
            try:
                self._queue.put_nowait(item)
                return published
            except queue.Full:
                try:
                    self._queue.get_nowait().settle(False)
                    self.stats.add(dropped=1)
                except queue.Empty:
                    pass

    def _publish_loop(self) -> None:
        lower_this_thread()  # encoding a context must not take a core from the model's steps
        while True:
            item = self._queue.get()
            if item is None:
                return
            if not self._link.available():
                self.stats.add(dropped=1)
                item.settle(False)
                continue
            try:
                self._publish(item.context)
                self.stats.add(published=1, publish_seconds=time.perf_counter() - item.queued)
                item.settle(True)
            except ERRORS as error:
                self.stats.add(dropped=1)
                item.settle(False)
                self._on_error("context publish", error)
            except BaseException:
                item.settle(False)
                raise

    def _publish(self, context: _Snapshot) -> None:
        prefix = self._prefix(context.tenant)
        blob = encode_context_tensors(context.tensors, context.meta, mac_key=self._mac_key)
        by_prefix = context.meta["length"] >= self.config.min_rows
        hashes = block_hashes(context.tenant, context.fingerprint, context.conversation_ids) if by_prefix else []
        pipe = self._client.pipeline(transaction=False)
        pipe.set(prefix + "kv:" + context.id, blob, px=self._ttl_ms)
        for digest in hashes:
            pipe.set(prefix + "block:" + digest.hex(), context.id, px=self._ttl_ms)
        pipe.pexpire(prefix + "lru", self._ttl_ms)
        pipe.pexpire(prefix + "sizes", self._ttl_ms)
        pipe.execute()
        # EVAL, not a registered script: registering would reach a cluster at construction
        dropped = self._client.eval(
            _ACCOUNT,
            2,
            prefix + "lru",
            prefix + "sizes",
            context.id,
            len(blob),
            time.time(),
            self.config.budget_bytes,
            prefix + "kv:",
        )
        self.stats.add(evicted=int(dropped))

    # -- finding (before a turn) --------------------------------------------------------

    def find(self, tenant: str, fingerprint: str, conversation_ids: list[int], at_least: int) -> Match | None:
        """The published context sharing the longest prefix with `conversation_ids`, when it
        covers more than `at_least` tokens (what this process holds already) by more than
        `min_gain` (any amount when this process holds nothing); None otherwise."""
        if not self._link.available():
            return None
        if at_least > 0 and len(conversation_ids) - at_least <= self.config.min_gain:
            return None  # what a fetch could add is cheaper to compute
        hashes = block_hashes(tenant, fingerprint, conversation_ids)
        first = at_least // BLOCK_TOKENS  # blocks this process holds already
        if first >= len(hashes):
            return None
        prefix = self._prefix(tenant)
        self.stats.add(lookups=1)
        try:
            owners = self._client.mget([prefix + "block:" + digest.hex() for digest in hashes[first:]])
            tried = set()
            for owner in reversed(owners):
                if owner is None or owner in tried:
                    continue
                tried.add(owner)
                context_id = owner.decode() if isinstance(owner, bytes) else owner
                blob = self._client.get(prefix + "kv:" + context_id)
                if blob is None:  # evicted or expired: its block keys outlive it until their TTL
                    continue
                match = self._match(blob, tenant, fingerprint, conversation_ids, at_least)
                if match is not None:
                    self._client.zadd(prefix + "lru", {context_id: time.time()})
                    self.stats.add(hits=1, hit_tokens=match.conversation_tokens)
                    return match
                if len(tried) >= 2:
                    break
        except ERRORS as error:
            self._on_error("context lookup", error)
        return None

    def load(self, tenant: str, context_id: str) -> Context | None:
        """The context another replica published under `context_id` (an id its answer
        named), renewed in the tenant's LRU; None when there is none (never published,
        evicted or expired) or it fails its check. Redis errors propagate (the caller
        decides between memory and a retry-later)."""
        prefix = self._prefix(tenant)
        blob = self._client.get(prefix + "kv:" + context_id)
        context = self._decoded(blob, tenant) if blob is not None else None
        if context is None or context.id != context_id:
            return None
        self._client.zadd(prefix + "lru", {context_id: time.time()})
        self.stats.add(loaded=1)
        return context

    def forget(self, tenant: str, context_id: str) -> bool:
        """Remove the context published under `context_id` (a deleted session): its id no
        longer continues on any replica. Its block keys lapse with their TTL (a lookup skips
        a key whose context is gone). Redis errors propagate."""
        prefix = self._prefix(tenant)
        pipe = self._client.pipeline(transaction=False)
        pipe.delete(prefix + "kv:" + context_id)
        pipe.zrem(prefix + "lru", context_id)
        pipe.hdel(prefix + "sizes", context_id)
        return bool(pipe.execute()[0])

    def _decoded(self, blob, tenant: str) -> Context | None:
        """The anonymous context of `tenant` a published blob holds; None when it fails its
        check or is another tenant's or a session."""
        try:
            context = decode_context(bytearray(blob), mac_key=self._mac_key)
        except CorruptBlobError as error:
            log.warning("ignoring a shared context that fails its check: %s", error)
            return None
        return None if context.tenant != tenant or context.explicit else context

    def _match(self, blob, tenant: str, fingerprint: str, conversation_ids: list[int], at_least: int) -> Match | None:
        context = self._decoded(blob, tenant)
        if context is None or context.fingerprint != fingerprint:
            return None
        shared = common_prefix(context.conversation_ids, conversation_ids)
        enough = at_least + self.config.min_gain if at_least > 0 else 0
        return Match(context, shared) if shared > enough else None

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=1)
        except queue.Full:
            pass
        self._thread.join(timeout=10)
