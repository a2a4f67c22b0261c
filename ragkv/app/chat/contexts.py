"""Cached chat contexts: the KV of earlier turns, found again by token prefix.

A `Context` holds a KV cache and what its rows are: the conversation's token ids (see
ragkv.app.chat.conversation) with document blocks spliced in (`insertions`). A new turn's
conversation ids are matched against the tenant's contexts by prefix, as vLLM's prefix
cache does: the ids are cut into blocks of BLOCK_TOKENS and each block's hash chains the
hash of the block before it (the chain's root is the tenant and the model fingerprint, so
tenants never share a context and another model's KV is never used). The deepest block
found names the candidates; the exact common prefix with their ids picks the longest.

Two kinds of contexts, with separate byte budgets, so one never evicts the other:
  sessions   explicit handles: a client continues a context by its `session_id`; an unknown
             or expired id is an error, never a silent fresh start;
  anonymous  every turn without a session id leaves one; a client that resends the whole
             history finds it by prefix. Naming an anonymous context's id makes it a session.

A context is checked out for the duration of a turn (a second turn on it meanwhile is
refused); anonymous contexts are taken out of the index while a turn extends them.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from ragkv.app.chat.conversation import common_prefix
from ragkv.engine.kv_cache import KVCache
from ragkv.ingest.errors import NotFoundError

BLOCK_TOKENS = 16


class SessionNotFoundError(NotFoundError):
    """An explicit session id that is unknown (never made, deleted or expired)."""

    code = "session_not_found"


class SessionStoreUnavailableError(Exception):
    """The shared session store cannot be asked now and this process holds no copy of the
    session: it may well exist, so this is not a 404 but a retry-later."""

    def __init__(self, session_id: str):
        super().__init__(f"the session store is unreachable and session {session_id!r} is not held here; retry shortly")
        self.session_id = session_id


class SessionBusyError(Exception):
    """The session is answering another request."""

    def __init__(self, session_id: str):
        super().__init__(f"session {session_id!r} is answering another request; retry when it is done")
        self.session_id = session_id


def new_context_id() -> str:
    return "sess_" + uuid.uuid4().hex


@dataclass(frozen=True)
class Insertion:
    """Document rows spliced into the conversation before conversation token `at`."""

    at: int
    rows: int
    chunk_hashes: tuple[str, ...]


@dataclass
class Context:
    id: str
    tenant: str
    fingerprint: str
    conversation_ids: list[int]
    row_ids: list[int]
    """Token id of every cache row: the conversation with the document blocks spliced in."""
    cache: KVCache
    insertions: list[Insertion] = field(default_factory=list)
    explicit: bool = False
    """A session (named by a client) rather than an anonymous context."""
    turns: int = 0
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    version: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def chunk_hashes(self) -> list[str]:
        return [h for insertion in self.insertions for h in insertion.chunk_hashes]

    def rows_for(self, conversation_tokens: int) -> int:
        """Cache rows that hold the first `conversation_tokens` conversation tokens."""
        return conversation_tokens + sum(i.rows for i in self.insertions if i.at < conversation_tokens)

    def chunks_before(self, conversation_tokens: int) -> set[str]:
        return {h for i in self.insertions if i.at < conversation_tokens for h in i.chunk_hashes}

    def cut(self, conversation_tokens: int) -> None:
        """Keep only what holds the first `conversation_tokens` conversation tokens, in place.
        Only the context's holder (a `checkout` or a `take`) may cut it, and what it cuts is
        lost unless saved first (a chat turn saves it: `_Saved` in ragkv.app.chat.turn).
        Raises ValueError, changing nothing, for a cut before the rows a released sliding
        window still needs (`KVCache.earliest_cut`)."""
        rows = self.rows_for(conversation_tokens)
        self.cache.truncate(rows)
        self.conversation_ids = self.conversation_ids[:conversation_tokens]
        self.row_ids = self.row_ids[:rows]
        self.insertions = [i for i in self.insertions if i.at < conversation_tokens]

    def summary(self) -> dict:
        return {
            "id": self.id,
            "turns": self.turns,
            "tokens": self.length,
            "chunks": len(self.chunk_hashes),
            "created": self.created,
            "updated": self.updated,
        }


def block_hashes(tenant: str, fingerprint: str, token_ids: list[int]) -> list[bytes]:
    """Chained hashes of the full BLOCK_TOKENS blocks of `token_ids`."""
    digest = hashlib.blake2b(f"{tenant}\0{fingerprint}".encode(), digest_size=16).digest()
    hashes = []
    for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = array("q", token_ids[start : start + BLOCK_TOKENS]).tobytes()
        digest = hashlib.blake2b(digest + block, digest_size=16).digest()
        hashes.append(digest)
    return hashes


@dataclass(frozen=True)
class Match:
    context: Context
    conversation_tokens: int
    """Length of the common prefix of the context's conversation ids and the query's."""


Key = tuple[str, str]


class ContextStore(Protocol):
    """Where chat turns find and leave their contexts: `ContextCache` (this process) or
    `ragkv.app.chat.session_store.RedisSessions` (sessions shared by replicas through Redis).

    Ownership: a context in the store belongs to the store; a turn reads its rows (copies a
    prefix) but writes them only while it holds the context, from a `checkout` (a session,
    by id) or a successful `take` (an anonymous context found by `match`) until its
    `release`. While held, a context is in no index: no other turn finds, takes or checks
    it out. A holder may `Context.cut` it and write rows after the cut; a turn that fails
    puts back what it cut (`ragkv.app.chat.turn`: `_Saved.restore`) before it releases
    the context. A context the turn built is handed over with `put` (anonymous) or with
    `release(..., context)` (a session).

    Failures of a remote store (Redis) are never raised by `match`, `put`, `release`,
    `shared`, `publication`, `delete`, `list` or `stats`: the store marks Redis down, keeps
    working from process memory and catches up once Redis answers. Only `checkout` raises,
    and it then holds nothing.
    """

    backend: str

    def match(self, tenant: str, fingerprint: str, conversation_ids: list[int]) -> Match | None:
        """The tenant's context (of this model) sharing the longest prefix with
        `conversation_ids`, or None. Changes no ownership: the store still owns the match,
        whose rows the caller may copy but not write (`take` it to write them). With Redis,
        a longer context another replica published may be the match: a decoded copy no one
        else holds. A failed Redis lookup gives the local match."""
        ...

    def take(self, context: Context) -> bool:
        """Take an anonymous context found by `match` out of the store for a turn.
        True: the caller holds it (out of the index) until it releases it, with None when
        the turn leaves a new context in its place (`put`) or as it was when the turn
        failed. False, changing nothing: it is gone (evicted, or taken by another turn
        meanwhile) or is not in this process's memory (a published copy); the caller then
        copies its rows, never writes them."""
        ...

    def put(self, context: Context) -> None:
        """Hand a new anonymous context to the store: before, the caller owns it (it built
        it and holds no checkout of its id); after, the store does and the caller must not
        write its rows (a later turn takes it). A context larger than the anonymous budget
        is dropped at once, and the least recently used ones are evicted to make room
        (counted in `stats`, not raised). With shared contexts, a snapshot is queued for
        Redis (`publication`); a full queue drops the oldest snapshot, a failed publish
        this one, both counted."""
        ...

    def checkout(self, tenant: str, session_id: str) -> Context:
        """Hold a context by id for one turn: before, the store owns it; after, the caller
        does, alone, until `release` (in Redis the session's lock, renewed by a heartbeat,
        keeps other replicas out; it expires if this process dies). An id that is not a
        session but an anonymous context, here or published by another replica, is checked
        out the same way and continues as a session. Raises, holding nothing:
        SessionBusyError while another turn holds it, SessionNotFoundError when there is no
        such context, SessionStoreUnavailableError when Redis cannot be asked and this
        process has no copy."""
        ...

    def release(self, tenant: str, session_id: str, context: Context | None) -> None:
        """End the caller's hold on `session_id` (from `checkout` or `take`): the store owns
        `context` from then on (the turn's new state, or the held context given back as it
        was), or, with None, keeps nothing under that id. A context deleted while held is
        not kept. With Redis, a session is written there and its lock freed; if Redis
        fails, the session is kept in memory, marked unshared (`shared`), and the heartbeat
        publishes it and frees the lock once Redis answers. Never raises for Redis."""
        ...

    def shared(self, context: Context) -> bool:
        """Whether another replica can continue `context` by its id now (in Redis). Reads
        only; changes no ownership."""
        ...

    def publication(self, tenant: str, context_id: str) -> Future[bool] | None:
        """The publish of the context a turn just left (resolved True once other replicas
        can find it, False if they will not), handed out once: what a chat answer's
        `session["shared"]` says (app.server.publication writes it); None when nothing is
        published (process memory)."""
        ...

    def delete(self, tenant: str, session_id: str) -> bool:
        """Forget a context everywhere (True if there was one). A context held now stays
        with its holder, and the store does not keep it when released."""
        ...

    def list(self, tenant: str) -> list[Context]:
        """The tenant's sessions held in this process's memory (not anonymous contexts, not
        the ones checked out now). The store keeps owning them: read only."""
        ...

    def stats(self) -> dict: ...

    def healthy(self) -> bool | None:
        """Whether the remote store answers; None when there is none."""
        ...

    def close(self) -> None: ...


class ContextCache:
    """In-process contexts: sessions and anonymous contexts in separate LRU byte budgets,
    both with an idle TTL, indexed by chained block hashes."""

    backend = "memory"

    def __init__(self, session_bytes: int, anonymous_bytes: int, ttl_s: float):
        self.budgets = {True: session_bytes, False: anonymous_bytes}
        self.ttl_s = ttl_s
        self._items: dict[bool, OrderedDict[Key, Context]] = {True: OrderedDict(), False: OrderedDict()}
        self._bytes = {True: 0, False: 0}
        self._index: dict[bytes, set[Key]] = {}
        self._hashes: dict[Key, list[bytes]] = {}
        self._busy: set[Key] = set()
        self._deleted_while_busy: set[Key] = set()
        self._lock = threading.Lock()
        self.evicted = {True: 0, False: 0}
        self.expired = 0

    # -- prefix matching ------------------------------------------------------------

    def match(self, tenant: str, fingerprint: str, conversation_ids: list[int]) -> Match | None:
        """The context of `tenant` sharing the longest prefix with `conversation_ids`."""
        hashes = block_hashes(tenant, fingerprint, conversation_ids)
        with self._lock:
            self._expire()
            candidates: set[Key] = set()
            for digest in hashes:
                found = self._index.get(digest)
                if not found:
                    break
                candidates = found
            best = None
            for key in candidates:
                context = self._get(key)
                if context is None or context.tenant != tenant or context.fingerprint != fingerprint:
                    continue
                length = common_prefix(context.conversation_ids, conversation_ids)
                if best is None or length > best.conversation_tokens:
                    best = Match(context, length)
            return best

    # -- checkout / release ---------------------------------------------------------

    def checkout(self, tenant: str, context_id: str, missing_ok: bool = False) -> Context | None:
        """Take a context out for a turn; SessionBusyError while another turn has it,
        SessionNotFoundError when there is none (None with `missing_ok`: the caller may
        find it elsewhere, and releases the checkout either way)."""
        key = (tenant, context_id)
        with self._lock:
            self._expire()
            if key in self._busy:
                raise SessionBusyError(context_id)
            context = self._pop(key)
            if context is None and not missing_ok:
                raise SessionNotFoundError(f"no session {context_id!r} (unknown, deleted or expired)")
            self._busy.add(key)
            return context

    def take(self, context: Context) -> bool:
        """Take an anonymous context found by `match` out for a turn; False if it is gone
        (evicted, or another turn took it meanwhile)."""
        key = (context.tenant, context.id)
        with self._lock:
            if key in self._busy or self._items[False].get(key) is not context:
                return False
            self._pop(key)
            self._busy.add(key)
            return True

    def release(self, tenant: str, context_id: str, context: Context | None) -> bool:
        """End a checkout; keep `context` (the new state) when given. False when the
        context was deleted during the checkout (it is not kept then)."""
        key = (tenant, context_id)
        with self._lock:
            self._busy.discard(key)
            if key in self._deleted_while_busy:
                self._deleted_while_busy.discard(key)
                return False
            if context is not None:
                self._put(key, context)
            return True

    def shared(self, context: Context) -> bool:
        """Whether another replica can continue `context` by its id now: never from process memory."""
        return False

    def publication(self, tenant: str, context_id: str) -> Future[bool] | None:
        return None  # nothing is published from process memory

    def healthy(self) -> bool | None:
        return None  # nothing remote to ask

    def close(self) -> None:
        pass

    def is_busy(self, tenant: str, context_id: str) -> bool:
        with self._lock:
            return (tenant, context_id) in self._busy

    def put(self, context: Context) -> None:
        with self._lock:
            self._put((context.tenant, context.id), context)

    def get(self, tenant: str, context_id: str) -> Context | None:
        with self._lock:
            return self._get((tenant, context_id))

    def delete(self, tenant: str, context_id: str) -> bool:
        """Forget a context; one checked out now is not kept when its turn ends."""
        key = (tenant, context_id)
        with self._lock:
            if key in self._busy:
                self._deleted_while_busy.add(key)
                return True
            return self._pop(key) is not None

    def list(self, tenant: str) -> list[Context]:
        """The tenant's sessions (anonymous contexts are not listed)."""
        with self._lock:
            self._expire()
            return [c for (owner, _), c in self._items[True].items() if owner == tenant]

    def stats(self) -> dict:
        with self._lock:
            self._expire()
            return {
                "backend": self.backend,
                "sessions": len(self._items[True]),
                "bytes": self._bytes[True],
                "capacity_bytes": self.budgets[True],
                "anonymous": len(self._items[False]),
                "anonymous_bytes": self._bytes[False],
                "anonymous_capacity_bytes": self.budgets[False],
                "busy": len(self._busy),
                "evicted": self.evicted[True],
                "anonymous_evicted": self.evicted[False],
                "expired": self.expired,
            }

    # -- under the lock ------------------------------------------------------------

    def _get(self, key: Key) -> Context | None:
        return self._items[True].get(key) or self._items[False].get(key)

    def _put(self, key: Key, context: Context) -> None:
        self._pop(key)
        kind = context.explicit
        if context.nbytes > self.budgets[kind]:
            self.evicted[kind] += 1
            return
        items = self._items[kind]
        items[key] = context
        self._bytes[kind] += context.nbytes
        hashes = block_hashes(context.tenant, context.fingerprint, context.conversation_ids)
        self._hashes[key] = hashes
        for digest in hashes:
            self._index.setdefault(digest, set()).add(key)
        while self._bytes[kind] > self.budgets[kind]:
            self._pop(next(iter(items)))
            self.evicted[kind] += 1

    def _pop(self, key: Key) -> Context | None:
        for kind in (True, False):
            context = self._items[kind].pop(key, None)
            if context is not None:
                self._bytes[kind] -= context.nbytes
                for digest in self._hashes.pop(key, ()):
                    keys = self._index.get(digest)
                    if keys is not None:
                        keys.discard(key)
                        if not keys:
                            del self._index[digest]
                return context
        return None

    def _expire(self) -> None:
        cutoff = time.time() - self.ttl_s
        for kind in (True, False):
            for key in [key for key, c in self._items[kind].items() if c.updated < cutoff]:
                self._pop(key)
                self.expired += 1
