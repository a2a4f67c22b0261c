"""The prefetch stage: each waiting request's fetch part (tokenize, retrieve, span look-ups,
store reads: no model; `Request.fetch`) runs here, on a thread of its own, ahead of its
admission, so the model thread only computes (ragkv.app.request, "fetch" and "prepare").

    Scheduler.add ─► submit: queued in arrival order
    the fetch thread: the next queued request's fetch, while the bytes it holds for the
        requests fetched and not yet prepared (the stored K/V they read) are under
        `max_bytes` ─► the request is ready; `on_ready` wakes the model worker
    Scheduler: admits the first ready waiting request (its arrival order kept among the
        ready) ─► release: its bytes leave the bound once its prepare ran (or it was dropped)

A fetch that fails (the store is down, a bad filter) is kept on its request: its prepare
raises it, so that request alone fails with it and the others go on. One fetch starts
only while the bound has room, so the bytes held stay under `max_bytes` plus one fetch
per thread (one always runs when none is held: a request larger than the bound still goes).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ragkv.app.request import Request

log = logging.getLogger("ragkv.app.server.prefetch")

DEFAULT_PREFETCH_MB = 512.0
"""Stored K/V read ahead of the model at most: a few prompts' worth of chunks."""


class Prefetcher:
    def __init__(self, max_bytes: int, threads: int = 1, on_ready: Callable[[], None] | None = None):
        if max_bytes < 1 or threads < 1:
            raise ValueError("max_bytes and threads must be >= 1")
        self.max_bytes = max_bytes
        self.on_ready = on_ready
        """Called (on a fetch thread) when a request's fetch finished."""
        self._cond = threading.Condition()
        self._queue: deque[Request] = deque()
        self._held: dict[int, int] = {}
        """Bytes of each request fetched and not yet released, by request id."""
        self._fetching: set[int] = set()
        self._released: set[int] = set()
        """Requests released while their fetch ran: their bytes are not held once it ends."""
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"ragkv-prefetch-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def held_bytes(self) -> int:
        """Bytes the fetched requests not yet prepared hold."""
        with self._cond:
            return sum(self._held.values())

    def submit(self, request: Request) -> None:
        """Fetch `request` ahead of its admission (a request without a fetch is ready already)."""
        if request.ready:
            return
        with self._cond:
            self._queue.append(request)
            self._cond.notify_all()

    def release(self, request: Request) -> None:
        """`request` was prepared or dropped: what it read leaves the bound."""
        with self._cond:
            if request.id in self._fetching:
                self._released.add(request.id)
            elif request in self._queue:
                self._queue.remove(request)
            self._held.pop(request.id, None)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the fetch threads (a fetch under way ends first; queued ones never start)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _next(self) -> Request | None:
        with self._cond:
            while not self._closed and not (self._queue and self._has_room()):
                self._cond.wait()
            if self._closed:
                return None
            request = self._queue.popleft()
            self._fetching.add(request.id)
            return request

    def _has_room(self) -> bool:
        return not self._held or sum(self._held.values()) < self.max_bytes

    def _run(self) -> None:
        while (request := self._next()) is not None:
            if not (request.sink is not None and request.sink.cancelled):  # a request gone is dropped unread
                request.run_fetch()
            fetched = request.fetched
            with self._cond:
                self._fetching.discard(request.id)
                if request.id in self._released:
                    self._released.discard(request.id)
                elif request.ready:
                    self._held[request.id] = fetched.nbytes if fetched is not None else 0
            if self.on_ready is not None:
                try:
                    self.on_ready()
                except Exception:
                    log.exception("prefetch ready hook failed")
