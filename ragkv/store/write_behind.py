"""Cache fills written behind: a chunk store whose writes that are not `required` are put
by a thread of its own, so the thread that computed them (the model's) does not wait for
the backend (a Redis round trip, an LMDB commit, the blob encoding).

    put / put_many (not required)  queued, readable at once through get / get_many
    the writer thread               puts each queued batch into the store, in order
    close                           waits until every queued write is put (nothing lost)

A `required` write (ingestion: it must not report success for data that went nowhere)
goes straight to the store, after the queued ones. Anything else is the store's own
(`__getattr__`). The queue holds at most `max_bytes` of tensors: a writer past it waits,
so a backend slower than the fills slows them rather than growing memory without end.
The tensors queued are the caller's packed copies (Engine.stored_chunk, encode_chunk):
nothing writes them after they are queued.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import torch

from ragkv.store.background import lower_this_thread
from ragkv.store.base import ChunkStore, PutItem, Tensors, _unpack_item
from ragkv.store.keys import ChunkKey

log = logging.getLogger("ragkv.store.write_behind")

DEFAULT_MAX_BYTES = 256 << 20

_Item = tuple[ChunkKey, Mapping[str, torch.Tensor], Mapping[str, str] | None]


class WriteBehindStore:
    def __init__(self, store: ChunkStore, max_bytes: int = DEFAULT_MAX_BYTES):
        self.store = store
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._queue: deque[tuple[list[_Item], int]] = deque()
        self._pending: dict[ChunkKey, Mapping[str, torch.Tensor]] = {}
        self._bytes = 0
        self._writing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ragkv-store-writer", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    # -- writes ---------------------------------------------------------------------

    def put(self, key: ChunkKey, tensors, metadata=None, *, required: bool = False) -> int:
        return self.put_many([(key, tensors, metadata)], required=required)

    def put_many(self, items: Iterable[PutItem], *, required: bool = False) -> int:
        """Queue the writes (returns 0: their blob bytes are known once written); a
        required write, or one after `close`, is put now (after the queued ones)."""
        batch = [_unpack_item(item) for item in items]
        if not batch:
            return 0
        if required or self._closed:
            self.flush()
            return self.store.put_many(batch, required=required)
        size = sum(_bytes(tensors) for _, tensors, _ in batch)
        with self._cond:
            while self._queue and self._bytes + size > self.max_bytes:
                self._cond.wait()
            self._queue.append((batch, size))
            self._bytes += size
            self._pending.update((key, tensors) for key, tensors, _ in batch)
            self._cond.notify_all()
        return 0

    # -- reads: the queued writes first ---------------------------------------------

    def get(self, key: ChunkKey) -> Tensors | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[ChunkKey]) -> list[Tensors | None]:
        with self._cond:
            queued = [self._pending.get(key) for key in keys]
        missing = [key for key, tensors in zip(keys, queued) if tensors is None]
        read = iter(self.store.get_many(missing) if missing else [])
        return [dict(tensors) if tensors is not None else next(read) for tensors in queued]

    def contains(self, key: ChunkKey) -> bool:
        with self._cond:
            if key in self._pending:
                return True
        return self.store.contains(key)

    # -- lifecycle ------------------------------------------------------------------

    @property
    def queued_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def flush(self) -> None:
        """Wait until every queued write is put."""
        with self._cond:
            while self._queue or self._writing:
                self._cond.wait()

    def close(self) -> None:
        """Put every queued write, then stop the writer (the store stays open: its owner closes it)."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        lower_this_thread()  # encoding and writing blobs must not take a core from the model's steps
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, size = self._queue[0]
                self._writing = True
            try:
                self.store.put_many(batch)
            except Exception:  # a cache fill the store cannot take is dropped, as put_many drops it
                log.exception("a queued write of %d chunk(s) failed", len(batch))
            with self._cond:
                self._queue.popleft()
                self._bytes -= size
                self._writing = False
                for key, tensors, _ in batch:
                    if self._pending.get(key) is tensors:
                        del self._pending[key]
                self._cond.notify_all()


def _bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
