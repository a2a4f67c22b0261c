"""Chat sessions: the fused KV of [prefix | chunks | turns] kept between turns.

A session holds the KV cache up to the opening of the assistant's last answer, the token
ids of those rows, and the text of that answer. The next turn appends
`ChatPrompt.turn_ids(message, previous_answer)` to the cache (an exact prefix: nothing
before it is recomputed) and decodes from there.

Stores:
  MemorySessions  in-process, bounded by the bytes of KV it holds (least recently used
                  dropped first), idle sessions expire after `ttl_s`.
  RedisSessions   shared by API replicas: the KV (safetensors blob via store.blob, with a
                  checksum; never pickle) and a small JSON meta record, both with a TTL.
                  A memory copy is used when its version matches the meta in Redis, so a
                  turn on the replica that served the previous one reads a few bytes from
                  Redis, not the KV. If Redis fails, sessions fall back to memory (and
                  /health says degraded).

A session is checked out for the duration of a turn; a second request for the same
session meanwhile gets 409 (a Redis lock does the same across replicas).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from ragkv.api.errors import ApiError
from ragkv.engine.kv_cache import KVCache
from ragkv.store.blob import decode_blob, encode_blob
from ragkv.store.errors import CorruptBlobError

log = logging.getLogger("ragkv.api.sessions")

_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_LOCK_MS = 120_000


def new_session_id() -> str:
    return "sess_" + uuid.uuid4().hex


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not _SESSION_ID.match(session_id):
        raise ApiError(400, "bad_session_id", "session_id must be 1-128 characters of [A-Za-z0-9_.:-]", param="session_id")
    return session_id


class SessionBusyError(ApiError):
    def __init__(self, session_id: str):
        super().__init__(409, "session_busy", f"session {session_id!r} is answering another request; retry when it is done",
                         param="session_id")


@dataclass
class Session:
    id: str
    tenant: str
    fingerprint: str
    token_ids: list[int]
    """Token ids of the cache's valid rows (the fused prompt and the turns so far)."""
    cache: KVCache
    last_answer: str | None = None
    """The previous answer's text: not yet in the cache (the next turn prefills it)."""
    chunk_hashes: list[str] = field(default_factory=list)
    citations: list[dict] = field(default_factory=list)
    turns: int = 0
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    version: str = ""

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        return self.cache.keys.nbytes + self.cache.values.nbytes

    def compact(self) -> None:
        """Drop spare capacity (the decode buffer) so the session holds only its valid rows."""
        if self.cache.capacity > self.cache.length:
            self.cache = self.cache.clone()

    def meta(self) -> dict:
        return {
            "id": self.id, "tenant": self.tenant, "fingerprint": self.fingerprint, "last_answer": self.last_answer,
            "chunk_hashes": self.chunk_hashes, "citations": self.citations, "turns": self.turns, "created": self.created,
            "updated": self.updated, "version": self.version, "length": self.length,
        }

    def summary(self) -> dict:
        return {"id": self.id, "turns": self.turns, "tokens": self.length, "chunks": len(self.chunk_hashes),
                "created": self.created, "updated": self.updated}


def encode_session(session: Session) -> bytes:
    rows = session.length
    tensors = {
        "keys": session.cache.keys[:, :, :rows],
        "values": session.cache.values[:, :, :rows],
        "tokens": torch.tensor(session.token_ids, dtype=torch.int32),
    }
    return encode_blob(tensors, {"session": json.dumps(session.meta())})


def decode_session(blob: bytes | bytearray | memoryview) -> Session:
    """Raises CorruptBlobError for anything that is not a valid session blob."""
    tensors, metadata = decode_blob(blob)
    try:
        meta = json.loads(metadata["session"])
        keys, values, tokens = tensors["keys"], tensors["values"], tensors["tokens"]
    except (KeyError, ValueError) as error:
        raise CorruptBlobError(f"not a session blob: {error}") from error
    rows = keys.shape[2]
    if values.shape != keys.shape or tokens.numel() != rows or meta.get("length") != rows:
        raise CorruptBlobError("session blob tensors disagree with its metadata")
    cache = KVCache(keys, values, rows, rows)
    return Session(meta["id"], meta["tenant"], meta["fingerprint"], tokens.tolist(), cache, meta["last_answer"],
                   meta["chunk_hashes"], meta["citations"], meta["turns"], meta["created"], meta["updated"], meta["version"])


class MemorySessions:
    """In-process sessions bounded by bytes, with an idle TTL."""

    backend = "memory"

    def __init__(self, capacity_bytes: int, ttl_s: float):
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._items: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self._busy: set[tuple[str, str]] = set()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = 0
        self.expired = 0

    def checkout(self, tenant: str, session_id: str) -> Session | None:
        key = (tenant, session_id)
        with self._lock:
            self._expire()
            if key in self._busy:
                raise SessionBusyError(session_id)
            session = self._pop(key)
            self._busy.add(key)
            return session

    def peek_version(self, tenant: str, session_id: str) -> str | None:
        with self._lock:
            session = self._items.get((tenant, session_id))
            return session.version if session is not None else None

    def release(self, tenant: str, session_id: str, session: Session | None) -> None:
        """End a checkout; keep `session` (the new state) when given."""
        key = (tenant, session_id)
        with self._lock:
            self._busy.discard(key)
            if session is not None:
                self._put(key, session)

    def put(self, session: Session) -> None:
        with self._lock:
            self._put((session.tenant, session.id), session)

    def delete(self, tenant: str, session_id: str) -> bool:
        with self._lock:
            return self._pop((tenant, session_id)) is not None

    def list(self, tenant: str) -> list[Session]:
        with self._lock:
            self._expire()
            return [session for (owner, _), session in self._items.items() if owner == tenant]

    def stats(self) -> dict:
        with self._lock:
            self._expire()
            return {"backend": self.backend, "sessions": len(self._items), "bytes": self._bytes,
                    "capacity_bytes": self.capacity_bytes, "busy": len(self._busy), "evicted": self.evicted,
                    "expired": self.expired}

    # -- under the lock ------------------------------------------------------------

    def _put(self, key: tuple[str, str], session: Session) -> None:
        self._pop(key)
        if session.nbytes > self.capacity_bytes:
            log.warning("session %s (%d bytes) is larger than the session memory; not kept in memory", session.id, session.nbytes)
            self.evicted += 1
            return
        self._items[key] = session
        self._bytes += session.nbytes
        while self._bytes > self.capacity_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= dropped.nbytes
            self.evicted += 1

    def _pop(self, key: tuple[str, str]) -> Session | None:
        session = self._items.pop(key, None)
        if session is not None:
            self._bytes -= session.nbytes
        return session

    def _expire(self) -> None:
        cutoff = time.time() - self.ttl_s
        for key in [key for key, session in self._items.items() if session.updated < cutoff]:
            self._pop(key)
            self.expired += 1


class RedisSessions:
    """Sessions in Redis (shared by replicas) with a memory copy; memory only while Redis is down."""

    backend = "redis"

    def __init__(self, url: str, memory: MemorySessions, ttl_s: float, *, connect_timeout_s: float = 0.5,
                 op_timeout_s: float = 2.0, retry_after_s: float = 1.0):
        self.memory = memory
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._retry_after_s = retry_after_s
        self._down_until = 0.0
        self._client = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=op_timeout_s,
                                            retry=Retry(NoBackoff(), 0))
        self._owner = uuid.uuid4().hex
        self.errors = 0
        self._logged_down = False
        self._lock = threading.Lock()

    @property
    def ttl_s(self) -> float:
        return self.ttl_ms / 1000

    @staticmethod
    def _key(tenant: str, session_id: str, part: str) -> str:
        return f"ragkv:session:{tenant}:{session_id}:{part}"

    def healthy(self) -> bool:
        try:
            self._client.ping()
        except redis.RedisError:
            return False
        self._down_until = 0.0
        return True

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, operation: str, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._down_until = time.monotonic() + self._retry_after_s
            if not self._logged_down:
                self._logged_down = True
                log.warning("session store: redis %s failed (%s); sessions fall back to process memory", operation, error)

    def _succeeded(self) -> None:
        if self._logged_down:
            with self._lock:
                self._logged_down = False
            log.warning("session store: redis is answering again")

    def checkout(self, tenant: str, session_id: str) -> Session | None:
        session = self.memory.checkout(tenant, session_id)  # local busy check first
        if not self._available():
            return session
        lock_key = self._key(tenant, session_id, "lock")
        try:
            if not self._client.set(lock_key, self._owner, nx=True, px=_LOCK_MS):
                self.memory.release(tenant, session_id, session)
                raise SessionBusyError(session_id)
            raw_meta = self._client.get(self._key(tenant, session_id, "meta"))
            if raw_meta is None:
                self._succeeded()
                return None if session is None else session  # expired in Redis: the memory copy, if any, stands
            meta = json.loads(raw_meta)
            # The memory copy stands when it is the one in Redis, or newer (saved while Redis was down).
            if session is not None and (session.version == meta.get("version") or session.turns > meta.get("turns", 0)):
                self._succeeded()
                return session
            blob = self._client.get(self._key(tenant, session_id, "kv"))
            self._succeeded()
        except SessionBusyError:
            raise
        except (redis.RedisError, ValueError) as error:
            self._failed("read", error)
            return session
        if blob is None:
            return session
        try:
            loaded = decode_session(blob)
        except CorruptBlobError as error:
            log.warning("dropping corrupt session %s from redis: %s", session_id, error)
            return session
        if loaded.tenant != tenant or loaded.id != session_id:
            return session
        return loaded

    def release(self, tenant: str, session_id: str, session: Session | None) -> None:
        self.memory.release(tenant, session_id, session)
        if not self._available():
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            if session is not None:
                pipe.set(self._key(tenant, session_id, "kv"), encode_session(session), px=self.ttl_ms)
                pipe.set(self._key(tenant, session_id, "meta"), json.dumps(session.meta()), px=self.ttl_ms)
            # Release the lock only if this process holds it.
            pipe.eval("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0",
                      1, self._key(tenant, session_id, "lock"), self._owner)
            pipe.execute()
            self._succeeded()
        except redis.RedisError as error:
            self._failed("write", error)

    def delete(self, tenant: str, session_id: str) -> bool:
        found = self.memory.delete(tenant, session_id)
        if self._available():
            try:
                found = bool(self._client.delete(*(self._key(tenant, session_id, p) for p in ("kv", "meta")))) or found
            except redis.RedisError as error:
                self._failed("delete", error)
        return found

    def list(self, tenant: str) -> list[Session]:
        return self.memory.list(tenant)

    def stats(self) -> dict:
        stats = self.memory.stats()
        stats["backend"] = self.backend
        stats["redis_errors"] = self.errors
        stats["redis_up"] = self.healthy()
        return stats

    def close(self) -> None:
        self._client.close()


def open_sessions(url: str | None, capacity_bytes: int, ttl_s: float) -> MemorySessions | RedisSessions:
    memory = MemorySessions(capacity_bytes, ttl_s)
    if url is None or url == "memory":
        return memory
    return RedisSessions(url, memory, ttl_s)
