"""The errors the application raises to its front ends, in one module: bad input, what is
not found, a busy or unreachable backend, a full queue, cancelled work. The API maps each
to a status (api.errors); the CLI prints the message and exits."""

from __future__ import annotations

from ragkv.app.chat.contexts import SessionBusyError, SessionStoreUnavailableError
from ragkv.app.request import RequestCancelled
from ragkv.errors import InputError
from ragkv.ingest.errors import NotFoundError, RegistryUnavailableError
from ragkv.store.errors import StoreUnavailableError


class QueueFull(Exception):
    """The work's queue is full (or the server is stopping): try again later."""

    def __init__(self, waiting: int):
        super().__init__(f"{waiting} requests are waiting")
        self.waiting = waiting


__all__ = [
    "InputError",
    "NotFoundError",
    "QueueFull",
    "RegistryUnavailableError",
    "RequestCancelled",
    "SessionBusyError",
    "SessionStoreUnavailableError",
    "StoreUnavailableError",
]
