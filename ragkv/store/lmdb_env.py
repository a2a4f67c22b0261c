"""One shared LMDB environment per directory, with named sub-databases.

Several parts of ragkv keep data in the same LMDB directory: the chunk store
(sub-db ``"chunks"``), the document registry and the embedding index.  LMDB
forbids opening one environment twice in a process, so
:class:`LMDBEnvironment` handles are cheap views onto a process-wide registry
keyed by real path; the environment closes when its last handle does.

Usage::

    env = LMDBEnvironment("/var/lib/ragkv/db")
    docs = env.db("documents")
    env.write(lambda txn: txn.put(b"doc/1", b"...", db=docs))
    with env.read() as txn:
        value = txn.get(b"doc/1", db=docs)   # memoryview, valid inside the block
    env.close()

Map size: LMDB needs an upper bound on the file size up front.  It is only
reserved address space, so we start big (64 GiB) and :meth:`write` doubles it
whenever a transaction does not fit, so a write never fails for a full map.
Resizing requires that no transaction is open in this process; handles
coordinate through a shared gate, so readers pause briefly while it happens,
and a thread must not call :meth:`write` while it holds :meth:`read` open.

Environments must be opened after ``fork()``, never inherited from a parent.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import lmdb

from ragkv.store.errors import StoreError

logger = logging.getLogger("ragkv.store")

DEFAULT_MAP_SIZE = 64 << 30
MAX_DBS = 32
"""Named sub-databases one environment may open (chunks, their recency and tenant counts,
the registry, jobs, journal, codebooks...); each costs a little on open, so headroom is cheap."""

_T = TypeVar("_T")


class _ResizeGate:
    """Shared/exclusive gate: transactions are shared, map resizing is exclusive.

    Writers are preferred so a steady stream of readers cannot starve a
    resize.  A thread that already holds the shared side cannot resize (it
    would wait for itself); that is reported instead of deadlocking.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False
        self._held = threading.local()

    def _depth(self) -> int:
        return getattr(self._held, "depth", 0)

    def acquire_shared(self) -> None:
        with self._cond:
            # Re-entrant for a thread already inside: waiting for a pending
            # resize would deadlock, since the resize waits for this thread.
            while self._resizing and not self._depth():
                self._cond.wait()
            self._active += 1
        self._held.depth = self._depth() + 1

    def release_shared(self) -> None:
        self._held.depth -= 1
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        if self._depth():
            raise RuntimeError(
                "the LMDB map must grow, but this thread has a transaction open; "
                "do not call write() inside read() or another write()"
            )
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class _SharedEnv:
    """The single ``lmdb.Environment`` behind all handles for one path."""

    def __init__(self, path: str, map_size: int) -> None:
        self.path = path
        self.pid = os.getpid()
        self.env = lmdb.open(path, map_size=map_size, max_dbs=MAX_DBS)
        self.gate = _ResizeGate()
        self.dbs: dict[str, object] = {}
        self.db_lock = threading.Lock()
        self.refs = 0


_registry: dict[str, _SharedEnv] = {}
_registry_lock = threading.Lock()


class LMDBEnvironment:
    """A handle on the process-wide LMDB environment at ``path`` (created if missing,
    unless ``create`` is false: then a missing environment is a ``FileNotFoundError`` and
    nothing is created, which is what commands that only read want).

    ``map_size`` is the initial map size in bytes when this handle is the
    first to open the path; later handles share whatever size the
    environment has grown to.
    """

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = DEFAULT_MAP_SIZE, create: bool = True) -> None:
        if isinstance(map_size, bool) or not isinstance(map_size, int) or map_size < 4096:
            raise ValueError(f"map_size must be an int >= 4096 bytes; got {map_size!r}")
        real = os.path.realpath(os.fspath(path))
        with _registry_lock:
            shared = _registry.get(real)
            if shared is not None and shared.pid != os.getpid():
                raise RuntimeError(f"LMDB environment {real} was opened before fork(); open it in the child process")
            if shared is None:
                if not create and not os.path.isfile(os.path.join(real, "data.mdb")):
                    raise FileNotFoundError(f"no LMDB database at {real}")
                os.makedirs(real, exist_ok=True)
                shared = _registry[real] = _SharedEnv(real, map_size)
            shared.refs += 1
        self._shared: _SharedEnv | None = shared

    @property
    def path(self) -> str:
        return self._env_state().path

    @property
    def map_size(self) -> int:
        return self._env_state().env.info()["map_size"]

    def db(self, name: str) -> object:
        """Handle of the named sub-database, created on first use.

        Pass it as ``db=`` to ``txn.get/put/delete/cursor``.  Names are
        shared by every user of the directory; pick a distinctive one.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("sub-database name must be a non-empty str")
        shared = self._env_state()
        with shared.db_lock:
            handle = shared.dbs.get(name)
            if handle is None:
                key = name.encode("utf-8")
                handle = shared.dbs[name] = self.write(lambda txn: shared.env.open_db(key, txn=txn))
            return handle

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """A read-only transaction; values are zero-copy ``memoryview`` s valid inside the block."""
        shared = self._env_state()
        txn = self._begin(shared, write=False)
        try:
            yield txn
        finally:
            txn.abort()
            shared.gate.release_shared()

    def write(self, fn: Callable[[lmdb.Transaction], _T]) -> _T:
        """Run ``fn(txn)`` in one write transaction, commit, and return its result.

        If the map fills up the transaction is aborted, the map doubled and
        ``fn`` run again, so ``fn`` must only act through ``txn``.  Any other
        exception aborts the transaction and propagates.
        """
        shared = self._env_state()
        while True:
            size = shared.env.info()["map_size"]
            txn = self._begin(shared, write=True)
            try:
                try:
                    result = fn(txn)
                except BaseException:
                    txn.abort()
                    raise
                txn.commit()
                return result
            except lmdb.MapFullError:
                pass  # grown below, once this thread has left the gate
            finally:
                shared.gate.release_shared()
            self._grow(shared, size)

    def close(self) -> None:
        """Release this handle; the environment closes with the last one.  Idempotent."""
        shared, self._shared = self._shared, None
        if shared is None:
            return
        with _registry_lock:
            shared.refs -= 1
            if shared.refs == 0:
                del _registry[shared.path]
                shared.env.close()

    def __enter__(self) -> LMDBEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _env_state(self) -> _SharedEnv:
        if self._shared is None:
            raise StoreError("LMDBEnvironment handle is closed")
        return self._shared

    @staticmethod
    def _begin(shared: _SharedEnv, *, write: bool) -> lmdb.Transaction:
        """Begin a transaction, returning with the gate held shared."""
        while True:
            shared.gate.acquire_shared()
            try:
                return shared.env.begin(write=write, buffers=True)
            except lmdb.MapResizedError:
                shared.gate.release_shared()
            except BaseException:
                shared.gate.release_shared()
                raise
            # Another process grew the map; adopt its size (needs no open txn here).
            with shared.gate.exclusive():
                shared.env.set_mapsize(0)

    @staticmethod
    def _grow(shared: _SharedEnv, observed: int) -> None:
        with shared.gate.exclusive():
            current = shared.env.info()["map_size"]
            if current <= observed:  # not already grown by a racing writer
                shared.env.set_mapsize(observed * 2)
                logger.info("LMDB map of %s full; grew it to %d MiB", shared.path, observed * 2 >> 20)
