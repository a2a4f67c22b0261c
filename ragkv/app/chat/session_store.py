"""Where chat contexts live: process memory (ragkv.app.chat.contexts.ContextCache), and Redis
for sessions shared by API replicas.

RedisSessions keeps every context in a ContextCache and, for sessions (contexts a client
named), also in Redis: the KV as a blob (app.chat.context_blob: a checksum, or the deployment
secret's MAC; never pickle) and a small JSON meta record, both with the session TTL. A
memory copy is used when its version matches the meta in Redis, so a turn on the replica
that served the previous one reads a few bytes from Redis, not the KV. Anonymous contexts
(turns without a session id) live in process memory within their own byte budget and,
when a shared budget is given, are also published for other replicas to find by prefix
(app.chat.shared_contexts) or by id: an id an anonymous turn's answer named, sent to any
replica with only the new message, continues there as a session (`checkout` reads the
published blob when Redis holds no session of that id). `publication` hands the API the
pending publish of the context a turn just left, so the answer's last event can wait for it.

A turn holds its session's Redis lock, which expires after `lock_ttl_s` unless renewed: a
heartbeat thread renews the locks this process holds, so a process killed mid-turn
leaves the session locked for at most `lock_ttl_s`; DELETE /v1/sessions/ID removes the
lock with the session. If Redis fails, sessions fall back to memory (/health says
degraded): a session this process holds keeps answering here, one it does not hold is a 503
with Retry-After (it may well exist in Redis), never a 404. A session whose write to Redis
was skipped or failed is remembered and published by the heartbeat once Redis answers again,
unless Redis holds a newer turn of it by then; until then the chat response says
`session.shared: false`, so a client knows the session continues only on this replica.

With a Redis Cluster URL (redis+cluster://...) a session's three keys carry the hash tag
{tenant:session_id}, so they share a slot and the lock script may name them together;
sessions spread over the masters, and a dead master fails only the sessions it held.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import Future

from ragkv.app.chat.context_blob import context_meta, decode_context, encode_context
from ragkv.app.chat.contexts import (
    Context,
    ContextCache,
    ContextStore,
    Match,
    SessionBusyError,
    SessionNotFoundError,
    SessionStoreUnavailableError,
)
from ragkv.app.chat.shared_contexts import SharedContextConfig, SharedContexts
from ragkv.store.blob import mac_key_of
from ragkv.store.errors import CorruptBlobError
from ragkv.store.redis_client import ERRORS, hash_tag
from ragkv.store.redis_link import RedisLink
from ragkv.store.url import redis_url_of_store

log = logging.getLogger("ragkv.app.chat.session_store")

_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Publish a session kept in memory while Redis was away: not over a newer turn written by
# another replica meanwhile (0), not while another process's turn holds its lock (-1: later),
# else written (1).
_PUBLISH = """
local meta = redis.call('get', KEYS[2])
if meta then
    local turns = cjson.decode(meta)['turns']
    if turns and turns > tonumber(ARGV[3]) then return 0 end
end
local holder = redis.call('get', KEYS[3])
if holder and holder ~= ARGV[5] then return -1 end
redis.call('set', KEYS[1], ARGV[1], 'px', ARGV[4])
redis.call('set', KEYS[2], ARGV[2], 'px', ARGV[4])
return 1
"""
_PUBLICATIONS_KEPT = 1024
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"


class RedisSessions:
    """Sessions in Redis (shared by replicas) with the memory cache in front; while Redis is
    down, sessions stay in memory. Anonymous contexts live in memory, and are published for
    other replicas when `shared` is given."""

    backend = "redis"

    def __init__(
        self,
        url: str,
        memory: ContextCache,
        ttl_s: float,
        *,
        lock_ttl_s: float = 10.0,
        connect_timeout_s: float = 0.5,
        op_timeout_s: float = 2.0,
        retry_after_s: float = 1.0,
        shared: SharedContextConfig | None = None,
        mac_key: bytes | None = None,
    ):
        self.memory = memory
        self._mac_key = mac_key
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.lock_ms = max(1, int(lock_ttl_s * 1000))
        self._link = RedisLink(
            url, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s, retry_after_s=retry_after_s
        )
        self._client = self._link.client
        self._owner = uuid.uuid4().hex
        self.errors = 0
        self._logged_down = False
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._unpublished: set[tuple[str, str]] = set()  # (tenant, session id) held only in memory
        self._unreleased: set[str] = set()  # locks a turn took whose release could not reach Redis
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._renew_locks, name="ragkv-session-locks", daemon=True)
        self._heartbeat.start()
        self.shared_contexts = (
            SharedContexts(self._link, shared, mac_key=mac_key, on_error=self._failed) if shared else None
        )
        self._publications: OrderedDict[tuple[str, str], Future[bool]] = OrderedDict()
        """Pending publishes of the anonymous contexts turns just left, until the API asks
        (`publication`); the oldest are forgotten past _PUBLICATIONS_KEPT (a client gone)."""

    @property
    def ttl_s(self) -> float:
        return self.ttl_ms / 1000

    def _key(self, tenant: str, session_id: str, part: str) -> str:
        if self._link.cluster:
            return f"ragkv:session:{hash_tag(f'{tenant}:{session_id}')}:{part}"
        return f"ragkv:session:{tenant}:{session_id}:{part}"

    def _release_lock(self, pipe, lock_key: str) -> None:
        """Free the lock if this process holds it: in the pipeline on one server; a cluster
        pipeline runs no scripts, so there it is its own call after the pipeline."""
        if self._link.cluster:
            pipe.execute()
            self._client.eval(_RELEASE, 1, lock_key, self._owner)
        else:
            pipe.eval(_RELEASE, 1, lock_key, self._owner)
            pipe.execute()

    def healthy(self) -> bool:
        return self._link.healthy()

    def _available(self) -> bool:
        return self._link.available()

    def _failed(self, operation: str, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._link.mark_down()
            if not self._logged_down:
                self._logged_down = True
                log.warning(
                    "session store: redis %s failed (%s); sessions fall back to process memory", operation, error
                )

    def _succeeded(self) -> None:
        if self._logged_down:
            with self._lock:
                self._logged_down = False
            log.warning("session store: redis is answering again")

    # -- what chat turns use ----------------------------------------------------------

    def match(self, tenant: str, fingerprint: str, conversation_ids: list[int]) -> Match | None:
        """The longest cached prefix: this process's, or a longer one another replica published."""
        local = self.memory.match(tenant, fingerprint, conversation_ids)
        if self.shared_contexts is None:
            return local
        held = local.conversation_tokens if local is not None else 0
        return self.shared_contexts.find(tenant, fingerprint, conversation_ids, held) or local

    def take(self, context: Context) -> bool:
        return self.memory.take(context)

    def put(self, context: Context) -> None:
        self.memory.put(context)
        if self.shared_contexts is None:
            return
        published = self.shared_contexts.offer(context)
        if published is not None:
            self._remember_publication((context.tenant, context.id), published)

    def _remember_publication(self, key: tuple[str, str], published: Future[bool]) -> None:
        with self._lock:
            self._publications.pop(key, None)
            self._publications[key] = published
            while len(self._publications) > _PUBLICATIONS_KEPT:
                self._publications.popitem(last=False)

    def publication(self, tenant: str, context_id: str) -> Future[bool] | None:
        """The publish of the context a turn just left (True once other replicas can find
        it), handed out once: pending for an anonymous context, resolved for a named
        session (written to Redis when released); None when there is none."""
        with self._lock:
            return self._publications.pop((tenant, context_id), None)

    def checkout(self, tenant: str, session_id: str) -> Context:
        context = self.memory.checkout(tenant, session_id, missing_ok=True)  # local busy check first
        if not self._available():
            return self._held_here(tenant, session_id, context)
        lock_key = self._key(tenant, session_id, "lock")
        try:
            with self._lock:
                stale = lock_key in self._unreleased
            if stale:  # this process's own lock, left while Redis was away
                self._free_own_lock(lock_key)
            if not self._client.set(lock_key, self._owner, nx=True, px=self.lock_ms):
                self.memory.release(tenant, session_id, context)
                raise SessionBusyError(session_id)
            with self._lock:
                self._held.add(lock_key)
            raw_meta = self._client.get(self._key(tenant, session_id, "meta"))
            if raw_meta is None:  # not a session in Redis: an anonymous context (here or published), or none
                if context is None and self.shared_contexts is not None:
                    context = self.shared_contexts.load(tenant, session_id)
                self._succeeded()
                return self._found(tenant, session_id, context)
            meta = json.loads(raw_meta)
            # The memory copy stands when it is the one in Redis, or newer (saved while Redis was down).
            if context is not None and (context.version == meta.get("version") or context.turns > meta.get("turns", 0)):
                self._succeeded()
                return context
            blob = self._client.get(self._key(tenant, session_id, "kv"))
            self._succeeded()
        except SessionBusyError:
            raise
        except (*ERRORS, ValueError) as error:
            self._failed("read", error)
            return self._held_here(tenant, session_id, context)
        if blob is None:
            return self._found(tenant, session_id, context)
        try:
            loaded = decode_context(blob, mac_key=self._mac_key)
        except CorruptBlobError as error:
            log.warning("dropping corrupt session %s from redis: %s", session_id, error)
            return self._found(tenant, session_id, context)
        if loaded.tenant != tenant or loaded.id != session_id:
            return self._found(tenant, session_id, context)
        return loaded

    def _found(self, tenant: str, session_id: str, context: Context | None) -> Context:
        if context is None:
            self.release(tenant, session_id, None)
            raise SessionNotFoundError(f"no session {session_id!r} (unknown, deleted or expired)")
        return context

    def _held_here(self, tenant: str, session_id: str, context: Context | None) -> Context:
        """Redis could not be asked: the memory copy if this process has one, else a retry-later."""
        if context is None:
            self.release(tenant, session_id, None)
            raise SessionStoreUnavailableError(session_id)
        return context

    def release(self, tenant: str, session_id: str, context: Context | None) -> None:
        if self._release(tenant, session_id, context):  # a named session, published by its write
            published: Future[bool] = Future()
            published.set_result(self.shared(context))
            self._remember_publication((tenant, session_id), published)

    def _release(self, tenant: str, session_id: str, context: Context | None) -> bool:
        """Whether the context was to be published (written to Redis, or kept to be)."""
        kept = self.memory.release(tenant, session_id, context)
        lock_key = self._key(tenant, session_id, "lock")
        publish = kept and context is not None and context.explicit
        with self._lock:
            self._held.discard(lock_key)
            if publish:
                self._unpublished.add((tenant, session_id))  # until the write below succeeds
            elif context is not None or not kept:
                self._unpublished.discard((tenant, session_id))
        if not self._available():
            with self._lock:
                self._unreleased.add(lock_key)
            return publish
        try:
            pipe = self._client.pipeline(transaction=False)
            if publish:
                blob = encode_context(context, mac_key=self._mac_key)
                pipe.set(self._key(tenant, session_id, "kv"), blob, px=self.ttl_ms)
                pipe.set(self._key(tenant, session_id, "meta"), json.dumps(context_meta(context)), px=self.ttl_ms)
            self._release_lock(pipe, lock_key)
            with self._lock:
                self._unreleased.discard(lock_key)
                if publish:
                    self._unpublished.discard((tenant, session_id))
            self._succeeded()
        except ERRORS as error:
            with self._lock:
                self._unreleased.add(lock_key)
            self._failed("write", error)
        return publish

    def _free_own_lock(self, lock_key: str) -> None:
        self._client.eval(_RELEASE, 1, lock_key, self._owner)
        with self._lock:
            self._unreleased.discard(lock_key)

    def shared(self, context: Context) -> bool:
        """Whether another replica can continue `context` by its id now (it is in Redis)."""
        with self._lock:
            return context.explicit and (context.tenant, context.id) not in self._unpublished

    def _publish_pending(self) -> None:
        """Once Redis answers again (heartbeat thread): free the locks whose release did not
        reach it, so other replicas need not wait for their expiry, then write the sessions
        kept only in memory meanwhile."""
        with self._lock:
            unreleased = [key for key in self._unreleased if key not in self._held]
        for lock_key in unreleased:
            self._free_own_lock(lock_key)
        with self._lock:
            pending = list(self._unpublished)
        for tenant, session_id in pending:
            if self.memory.is_busy(tenant, session_id):
                continue  # its turn's release writes it
            context = self.memory.get(tenant, session_id)
            if context is None:  # evicted, expired or deleted: nothing left to publish
                with self._lock:
                    self._unpublished.discard((tenant, session_id))
                continue
            keys = [self._key(tenant, session_id, part) for part in ("kv", "meta", "lock")]
            meta = json.dumps(context_meta(context))
            blob = encode_context(context, mac_key=self._mac_key)
            done = self._client.eval(_PUBLISH, 3, *keys, blob, meta, context.turns, self.ttl_ms, self._owner)
            if done != -1:
                with self._lock:
                    if self.memory.get(tenant, session_id) is context:  # not replaced by a turn meanwhile
                        self._unpublished.discard((tenant, session_id))

    def _renew_locks(self) -> None:
        while not self._stop.wait(self.lock_ms / 3000):
            if not self._available():
                continue
            try:
                self._publish_pending()
            except ERRORS as error:
                self._failed("publish", error)
                continue
            with self._lock:
                held = list(self._held)
            if not held:
                continue
            try:
                if self._link.cluster:  # no scripts in a cluster pipeline
                    for key in held:
                        self._client.eval(_RENEW, 1, key, self._owner, self.lock_ms)
                    continue
                pipe = self._client.pipeline(transaction=False)
                for key in held:
                    pipe.eval(_RENEW, 1, key, self._owner, self.lock_ms)
                pipe.execute()
            except ERRORS as error:
                self._failed("lock renewal", error)

    # -- the session routes -----------------------------------------------------------

    def delete(self, tenant: str, session_id: str) -> bool:
        """Forget a session everywhere and free its lock (a turn still running on it
        keeps nothing when it ends)."""
        found = self.memory.delete(tenant, session_id)
        with self._lock:
            self._unpublished.discard((tenant, session_id))
        if self._available():
            try:
                keys = [self._key(tenant, session_id, part) for part in ("kv", "meta", "lock")]
                found = bool(self._client.delete(*keys[:2])) or found
                self._client.delete(keys[2])
                if self.shared_contexts is not None:  # an anonymous turn's id, published for other replicas
                    found = self.shared_contexts.forget(tenant, session_id) or found
            except ERRORS as error:
                self._failed("delete", error)
        return found

    def list(self, tenant: str) -> list[Context]:
        return self.memory.list(tenant)

    def stats(self) -> dict:
        stats = self.memory.stats()
        stats["backend"] = self.backend
        stats["redis_errors"] = self.errors
        stats["redis_up"] = self.healthy()
        with self._lock:
            stats["unpublished"] = len(self._unpublished)
        if self.shared_contexts is not None:
            stats["shared_contexts"] = self.shared_contexts.stats.snapshot()
        return stats

    def close(self) -> None:
        if self.shared_contexts is not None:
            self.shared_contexts.close()
        self._stop.set()
        self._heartbeat.join(timeout=5)
        self._client.close()


def open_sessions(
    url: str | None,
    session_bytes: int,
    anonymous_bytes: int,
    ttl_s: float,
    lock_ttl_s: float = 10.0,
    *,
    shared_bytes: int = 0,
    shared_codes: str = "16bit",
    mac_key: bytes | None = None,
) -> ContextStore:
    """Contexts in process memory, or with a Redis URL sessions shared by replicas and, with
    `shared_bytes` > 0, anonymous contexts published for them (that many bytes per tenant,
    their KV as `shared_codes`: 16bit or int8)."""
    memory = ContextCache(session_bytes, anonymous_bytes, ttl_s)
    if url is None or url == "memory":
        return memory
    shared = SharedContextConfig(shared_bytes, ttl_s, kv_codes=shared_codes) if shared_bytes > 0 else None
    return RedisSessions(url, memory, ttl_s, lock_ttl_s=lock_ttl_s, shared=shared, mac_key=mac_key)


def sessions_url(session_store: str | None, store_url: str | None) -> str | None:
    """Where sessions live: `session_store` when given, else the Redis of the chunk store's
    URL (sessions are shared by the replicas that share chunks), else process memory."""
    return session_store or redis_url_of_store(store_url)


def session_mac_key(store_secret: str | None) -> bytes | None:
    """The key that authenticates session blobs: the chunk store's, when it has a secret."""
    return mac_key_of(store_secret) if store_secret else None
