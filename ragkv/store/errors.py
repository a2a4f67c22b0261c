"""Exceptions raised by the chunk store.

Everything derives from :class:`StoreError` so callers can catch store problems
without also swallowing programming errors (``TypeError`` for a wrong key type,
``ValueError`` for a malformed URL, ...).
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class for chunk-store failures."""


class CorruptBlobError(StoreError):
    """A stored blob is truncated, garbled or fails its checksum.

    Raised only by :func:`store.blob.decode_blob`; the stores turn it into a
    cache miss (a corrupt chunk is recomputed, never served).
    """


class StoreUnavailableError(StoreError):
    """A remote backend is known to be down and was not contacted.

    Raised internally while a backend is backing off after a connection
    failure so that a dead cache costs nothing per request; the store layer
    treats it like any other transient failure (miss on read, dropped write).
    """
