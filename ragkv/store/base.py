"""The chunk-store contract and the shared machinery behind every backend.

:class:`ChunkStore` is what the rest of ragkv talks to.  It owns everything
that must behave identically across backends, written once here:

* blob encoding on write and verified decoding on read (:mod:`store.blob`);
* hit / miss / corrupt / error accounting;
* the failure policy: a corrupt blob is logged, dropped and reported as a
  miss, and a backend's *transient* errors (``_transient_errors``, e.g. a
  dead Redis) become a miss on read and a dropped write, logged once per
  outage.  Everything else propagates.

Backends that hold bytes subclass :class:`BlobStore` and implement a handful
of raw primitives on ``bytes`` keys; composite stores (:class:`store.tiered.
TieredStore`) subclass :class:`ChunkStore` directly and implement ``_load``.

Tensors returned by a store must be treated as read-only: stores with an
in-process cache hand the same tensor objects to every caller.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, TypeVar

import torch

from ragkv.store.blob import decode_blob, encode_blob
from ragkv.store.burst_log import BurstLog
from ragkv.store.errors import CorruptBlobError, StoreError, StoreUnavailableError
from ragkv.store.keys import KEY_NAMESPACE, ChunkKey
from ragkv.store.stats import StoreStats
from ragkv.store.tenant_budgets import TenantBudgets
from ragkv.store.tenant_stats import TenantCounters

logger = logging.getLogger("ragkv.store")

Tensors = dict[str, torch.Tensor]
RawBlob = bytes | bytearray | memoryview
PutItem = (
    tuple[ChunkKey, Mapping[str, torch.Tensor]] | tuple[ChunkKey, Mapping[str, torch.Tensor], Mapping[str, str] | None]
)
"""An item for :meth:`ChunkStore.put_many`: ``(key, tensors)`` or ``(key, tensors, metadata)``."""

_T = TypeVar("_T")
_NO_BUDGETS = TenantBudgets()


@dataclass(frozen=True)
class ChunkEntry:
    """A decoded, checksum-verified chunk: its tensors and the metadata stored with them."""

    tensors: Tensors
    metadata: dict[str, str]

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, dict) or not isinstance(self.metadata, dict):
            raise TypeError("ChunkEntry holds a dict of tensors and a dict of metadata")


@dataclass(frozen=True)
class Loaded:
    """A verified entry plus the blob it was decoded from.

    The tensors are views into ``blob``, so keeping both costs nothing extra;
    composite stores copy ``blob`` into upper tiers without re-encoding.
    """

    entry: ChunkEntry
    blob: bytearray

    @property
    def nbytes(self) -> int:
        return len(self.blob)


class StoreUsage(NamedTuple):
    """What a backend currently holds, as reported by ``_usage`` (``None``: unknown)."""

    entries: int | None
    bytes: int | None
    protected_bytes: int | None = None
    """Bytes of chunks read since written, which a capped store evicts last (segmented LRU)."""


def _check_keys(keys: Iterable[ChunkKey]) -> list[ChunkKey]:
    checked = list(keys)
    for key in checked:
        if not isinstance(key, ChunkKey):
            raise TypeError(f"store keys must be ChunkKey, not {type(key).__name__}")
    return checked


def _unpack_item(item: PutItem) -> tuple[ChunkKey, Mapping[str, torch.Tensor], Mapping[str, str] | None]:
    if not isinstance(item, tuple) or len(item) not in (2, 3):
        raise TypeError("put_many items are (key, tensors) or (key, tensors, metadata) tuples")
    key, tensors, metadata = item if len(item) == 3 else (*item, None)
    if not isinstance(key, ChunkKey):
        raise TypeError(f"store keys must be ChunkKey, not {type(key).__name__}")
    return key, tensors, metadata


class ChunkStore(ABC):
    """Content-addressed cache of chunk KV tensors (see the module docstring)."""

    backend: ClassVar[str]
    """Short backend name reported in :class:`StoreStats` (``"lmdb"``, ``"redis"``, ...)."""

    _transient_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    """Exceptions that mean "backend unavailable": absorbed and counted, never raised."""

    durable: ClassVar[bool] = False
    """Whether a write here survives the process and a restart of the backend (LMDB: yes;
    a cache such as Redis: no). A required write must reach a durable tier."""

    keeps_tenant_budgets: ClassVar[bool] = False
    """Whether :meth:`set_tenant_budgets` bounds each tenant's bytes here (LMDB, one Redis server)."""

    def __init__(self, *, mac_key: bytes | None = None) -> None:
        if mac_key is not None and (not isinstance(mac_key, bytes) or len(mac_key) < 16):
            raise ValueError("mac_key must be at least 16 bytes (see store.blob.mac_key_of)")
        self._mac_key = mac_key
        self._counter_lock = threading.Lock()
        self._hits = self._misses = self._corrupt = self._errors = self._evictions = 0
        self._tenant_counts = TenantCounters()
        self._closed = False
        self._burst_log = BurstLog(logger, f"{self.backend} store")
        self._last_error: BaseException | None = None

    # ----------------------------------------------------------------- reads

    def get(self, key: ChunkKey) -> Tensors | None:
        """Tensors stored under ``key``, or ``None`` on a miss (including corruption)."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[ChunkKey]) -> list[Tensors | None]:
        """Batched :meth:`get`; results are in ``keys`` order, ``None`` for each miss."""
        return [loaded.entry.tensors if loaded else None for loaded in self._lookup(keys)]

    def get_entry(self, key: ChunkKey) -> ChunkEntry | None:
        """Like :meth:`get` but also returns the metadata stored with the tensors."""
        return self.get_entries([key])[0]

    def get_entries(self, keys: Sequence[ChunkKey]) -> list[ChunkEntry | None]:
        """Batched :meth:`get_entry`, in ``keys`` order."""
        return [loaded.entry if loaded else None for loaded in self._lookup(keys)]

    def contains(self, key: ChunkKey) -> bool:
        """Whether ``key`` is stored (without verifying it; :meth:`get` still may miss)."""
        (key,) = _check_keys([key])
        self._check_open()
        return self._contains_key(key.to_bytes())

    def blob_size(self, key: ChunkKey) -> int | None:
        """Bytes stored under ``key`` (unverified), ``None`` when absent or unreachable."""
        (key,) = _check_keys([key])
        self._check_open()
        return self._attempt("size", self._size_raw, key.to_bytes(), fallback=None)

    def iter_keys(self, prefix: bytes = KEY_NAMESPACE) -> Iterator[ChunkKey]:
        """Stored keys whose byte form starts with ``prefix`` (see :func:`store.keys.key_prefix`).

        Meant for garbage collection; no ordering is promised.  Keys written
        by something other than this package are skipped.
        """
        if not isinstance(prefix, bytes):
            raise TypeError("prefix must be bytes")
        self._check_open()
        return self._parse_keys(self._iter_raw_keys(prefix))

    def _parse_keys(self, raw_keys: Iterator[bytes]) -> Iterator[ChunkKey]:
        while True:
            raw = self._attempt("iter_keys", next, raw_keys, None, fallback=None)
            if raw is None:
                return
            try:
                yield ChunkKey.from_bytes(raw)
            except ValueError:
                logger.debug("skipping foreign key %r in %s store", raw, self.backend)

    # ---------------------------------------------------------------- writes

    def put(
        self,
        key: ChunkKey,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
        *,
        required: bool = False,
    ) -> int:
        """Store ``tensors`` (and string ``metadata``) under ``key``, replacing any old value;
        returns the bytes of the blob written."""
        return self.put_many([(key, tensors, metadata)], required=required)

    def put_many(self, items: Iterable[PutItem], *, required: bool = False) -> int:
        """Store several chunks in one backend round trip / transaction; returns the blobs' bytes.

        A write the backend cannot take is dropped (counted, logged) unless ``required``:
        then it raises :class:`StoreUnavailableError`, for writers that must not report
        success for data that went nowhere (ingestion). A cache refill is not required."""
        self._check_open()
        pairs = []
        for item in items:
            key, tensors, metadata = _unpack_item(item)
            pairs.append((key.to_bytes(), encode_blob(tensors, metadata, mac_key=self._mac_key)))
        if pairs and not self._store_raw(pairs) and required:
            raise StoreUnavailableError(f"the {self.backend} store could not take the write: {self._last_error}")
        return sum(len(blob) for _, blob in pairs)

    def delete(self, key: ChunkKey) -> bool:
        """Remove ``key``; ``True`` if something was removed."""
        (key,) = _check_keys([key])
        self._check_open()
        return self._delete_key(key.to_bytes())

    # ------------------------------------------------------------ lifecycle

    def stats(self) -> StoreStats:
        usage = self._attempt("stats", self._usage, fallback=None) if not self._closed else None
        held = self._attempt("tenant bytes", self._tenant_bytes_of_stats, fallback=None) if not self._closed else None
        with self._counter_lock:
            return StoreStats(
                backend=self.backend,
                entries=usage.entries if usage else None,
                bytes=usage.bytes if usage else None,
                hits=self._hits,
                misses=self._misses,
                corrupt=self._corrupt,
                errors=self._errors,
                evictions=self._evictions,
                capacity_bytes=self.capacity_bytes,
                protected_bytes=usage.protected_bytes if usage else None,
                tenants=self._tenant_counts.snapshot(held),
            )

    def tenant_bytes(self) -> dict[str, int] | None:
        """Blob bytes per tenant a key names (``""``: shared chunks), as counted with every
        write; ``None`` where the backend does not count them or cannot be asked."""
        return None

    def _tenant_bytes_of_stats(self) -> dict[str, int] | None:
        """The per-tenant bytes :meth:`stats` reports (a backend where they are costly to read says None)."""
        return self.tenant_bytes()

    @property
    def tenant_budgets(self) -> TenantBudgets:
        """The budgets this store keeps (none unless set)."""
        return _NO_BUDGETS

    def set_tenant_budgets(self, budgets: TenantBudgets) -> None:
        """Bound each tenant's bytes (:class:`store.tenant_budgets.TenantBudgets`); a store
        that does not keep budgets refuses any."""
        if budgets.any:
            raise ValueError(
                f"a {self.backend} chunk store here keeps no per-tenant budgets (LMDB and a single Redis server do)"
            )

    def recount(self) -> dict[str, int] | None:
        """Rebuild the per-tenant counts from a full scan; returns them (``None``: not counted)."""
        return None

    @property
    def capacity_bytes(self) -> int | None:
        """The most bytes of chunks this store keeps (the eviction order is the backend's); None: unbounded."""
        return None

    def close(self) -> None:
        """Release the backend; idempotent.  Further use raises :class:`StoreError`."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------- shared implementation

    def _lookup(self, keys: Sequence[ChunkKey]) -> list[Loaded | None]:
        """Load ``keys`` and account hits/misses; what composite stores call on their tiers."""
        keys = _check_keys(keys)
        self._check_open()
        if not keys:
            return []
        loaded = self._load(keys)
        found = [item is not None for item in loaded]
        hits = sum(found)
        with self._counter_lock:
            self._hits += hits
            self._misses += len(keys) - hits
            self._tenant_counts.looked_up([key.tenant for key in keys], found)
        return loaded

    # The guarded forms of the primitives: what composite stores call on their tiers.

    def _store_raw(self, pairs: list[tuple[bytes, RawBlob]]) -> bool:
        """Write; ``False`` when a transient failure dropped the write."""
        return self._attempt("put", self._put_raw_many, pairs, fallback=False) is not False

    def _delete_key(self, key: bytes) -> bool:
        return self._attempt("delete", self._delete_raw, key, fallback=False)

    def _contains_key(self, key: bytes) -> bool:
        return self._attempt("contains", self._contains_raw, key, fallback=False)

    def _attempt(self, operation: str, fn: Callable[..., _T], *args: object, fallback: _T) -> _T:
        """Run one backend call, turning a transient failure into ``fallback``."""
        try:
            result = fn(*args)
        except self._transient_errors as exc:
            with self._counter_lock:
                self._errors += 1
                self._last_error = exc
            self._burst_log.failure(operation, exc)
            return fallback
        self._burst_log.success()
        return result

    def _count_corrupt(self) -> None:
        with self._counter_lock:
            self._corrupt += 1

    def _count_evictions(self, evicted: int) -> None:
        with self._counter_lock:
            self._evictions += evicted

    def _count_tenant_evictions(self, evicted: Mapping[str, int]) -> None:
        with self._counter_lock:
            self._evictions += sum(evicted.values())
            self._tenant_counts.evicted(evicted)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.backend} store is closed")

    # -------------------------------------------------- backend primitives

    @abstractmethod
    def _load(self, keys: list[ChunkKey]) -> list[Loaded | None]:
        """Verified entries for ``keys`` (non-empty), ``None`` per miss."""

    @abstractmethod
    def _put_raw_many(self, pairs: list[tuple[bytes, RawBlob]]) -> None:
        """Write ``(key bytes, blob)`` pairs, atomically where the backend can."""

    def _note_used(self, keys: list[bytes]) -> None:
        """Reads of ``keys`` that a tier above served (from memory): a store that orders its
        eviction by use records them as its own reads. Others ignore them."""

    @abstractmethod
    def _delete_raw(self, key: bytes) -> bool: ...

    @abstractmethod
    def _contains_raw(self, key: bytes) -> bool: ...

    @abstractmethod
    def _size_raw(self, key: bytes) -> int | None: ...

    @abstractmethod
    def _usage(self) -> StoreUsage: ...

    @abstractmethod
    def _iter_raw_keys(self, prefix: bytes) -> Iterator[bytes]: ...

    @abstractmethod
    def _close(self) -> None: ...


class BlobStore(ChunkStore):
    """A :class:`ChunkStore` over a byte key-value backend.

    Subclasses add ``_get_raw_many``; decoding, checksum verification and the
    handling of corrupt blobs happen here, once for all backends.
    """

    @abstractmethod
    def _get_raw_many(self, keys: list[bytes]) -> list[RawBlob | None]:
        """Raw blobs for ``keys``; buffers must stay valid after the call returns."""

    def _load(self, keys: list[ChunkKey]) -> list[Loaded | None]:
        raws = self._attempt("get", self._get_raw_many, [key.to_bytes() for key in keys], fallback=None)
        if raws is None:
            return [None] * len(keys)
        return [None if raw is None else self._verify(key, raw) for key, raw in zip(keys, raws)]

    def _verify(self, key: ChunkKey, raw: RawBlob) -> Loaded | None:
        # One copy into a private writable buffer; decode_blob then maps tensors onto it.
        blob = raw if isinstance(raw, bytearray) else bytearray(raw)
        try:
            tensors, metadata = decode_blob(blob, mac_key=self._mac_key)
        except CorruptBlobError as exc:
            logger.warning("dropping corrupt blob %r from %s store: %s", key.to_bytes(), self.backend, exc)
            self._count_corrupt()
            self._delete_key(key.to_bytes())
            return None
        return Loaded(ChunkEntry(tensors, metadata), blob)
