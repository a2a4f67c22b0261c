"""Content-addressed keys for cached chunk KV blobs.

A cached KV tensor is only valid for the exact model that produced it and the
exact token ids of the chunk, and only for the blob layout it was written
with.  :class:`ChunkKey` makes all three part of the key, so a model upgrade or
a layout change can never serve stale tensors: it simply misses.

A key also names the tenant whose rows it holds (``@TENANT``; absent for chunks shared
across tenants), so a store can count, bound and evict each tenant's bytes from the key
alone, and one tenant's key can never address another's rows.
"""

from __future__ import annotations

import hashlib
import operator
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

KEY_NAMESPACE = b"kv/"
"""Prefix of every chunk key; lets a shared keyspace hold other data too."""

_FIELD_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
TENANT_MARK = b"@"
"""Starts a key's tenant field: a chunk hash never starts with it, so the two layouts
(with and without a tenant) parse apart."""
# int32, as token ids are stored by every tokenizer we serve.
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _check_field(name: str, value: object) -> None:
    if not isinstance(value, str) or not _FIELD_RE.fullmatch(value):
        raise ValueError(
            f"ChunkKey.{name} must be 1-128 characters of [A-Za-z0-9._-] "
            f"(no '/', it separates key fields); got {value!r}"
        )


def check_tenant(value: object) -> None:
    if not isinstance(value, str) or (value and not _TENANT_RE.fullmatch(value)):
        raise ValueError(f"ChunkKey.tenant must be '' (shared) or 1-64 characters of [A-Za-z0-9._-]; got {value!r}")


def _check_version(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ChunkKey.format_version must be an int >= 1; got {value!r}")


@dataclass(frozen=True)
class ChunkKey:
    """Identity of one cached chunk: ``kv/{format_version}/{model_fingerprint}/@{tenant}/{chunk_hash}``,
    or ``kv/{format_version}/{model_fingerprint}/{chunk_hash}`` for a chunk no tenant owns
    (``tenant=""``: shared across tenants).

    The version comes first so that a whole layout generation can be listed
    (and garbage-collected) with one prefix scan; see :func:`key_prefix`.
    """

    model_fingerprint: str
    chunk_hash: str
    format_version: int
    tenant: str = ""

    def __post_init__(self) -> None:
        _check_field("model_fingerprint", self.model_fingerprint)
        _check_field("chunk_hash", self.chunk_hash)
        _check_version(self.format_version)
        check_tenant(self.tenant)
        if self.chunk_hash.startswith(TENANT_MARK.decode()):
            raise ValueError(f"ChunkKey.chunk_hash must not start with {TENANT_MARK!r}; got {self.chunk_hash!r}")

    def to_bytes(self) -> bytes:
        tenant = TENANT_MARK + self.tenant.encode("ascii") + b"/" if self.tenant else b""
        return b"%s%d/%s/%s%s" % (
            KEY_NAMESPACE,
            self.format_version,
            self.model_fingerprint.encode("ascii"),
            tenant,
            self.chunk_hash.encode("ascii"),
        )

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> ChunkKey:
        """Parse :meth:`to_bytes` output; ``ValueError`` for anything else."""
        data = bytes(raw)
        if not data.startswith(KEY_NAMESPACE):
            raise ValueError(f"not a chunk key (missing {KEY_NAMESPACE!r} prefix): {data!r}")
        parts = data[len(KEY_NAMESPACE) :].split(b"/")
        tenant = b""
        if len(parts) == 4 and parts[2].startswith(TENANT_MARK):
            tenant = parts.pop(2)[len(TENANT_MARK) :]
            if not tenant:
                raise ValueError(f"malformed chunk key {data!r}: empty tenant field")
        if len(parts) != 3 or not parts[0].isdigit():
            raise ValueError(f"malformed chunk key {data!r}; expected kv/<version>/<model>/[@<tenant>/]<hash>")
        try:
            fingerprint, chunk_hash = parts[1].decode("ascii"), parts[2].decode("ascii")
            return cls(fingerprint, chunk_hash, int(parts[0]), tenant.decode("ascii"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"malformed chunk key {data!r}: non-ASCII field") from exc


def tenant_of(raw: bytes | bytearray | memoryview) -> str:
    """The tenant a stored key names (``""``: shared, or not a tenant-keyed chunk key); reads
    only the bytes, so a store can attribute a key it holds without parsing it fully."""
    data = bytes(raw)
    parts = data.split(b"/", 5)
    if len(parts) == 5 and data.startswith(KEY_NAMESPACE) and parts[3].startswith(TENANT_MARK):
        try:
            return parts[3][len(TENANT_MARK) :].decode("ascii")
        except UnicodeDecodeError:
            return ""
    return ""


def key_prefix(format_version: int | None = None, model_fingerprint: str | None = None) -> bytes:
    """Byte prefix selecting all keys of a format version (and optionally a model).

    Used with ``ChunkStore.iter_keys`` to find entries to garbage-collect after
    a model or layout change.
    """
    if format_version is None:
        if model_fingerprint is not None:
            raise ValueError("a model_fingerprint prefix needs a format_version")
        return KEY_NAMESPACE
    _check_version(format_version)
    prefix = b"%s%d/" % (KEY_NAMESPACE, format_version)
    if model_fingerprint is None:
        return prefix
    _check_field("model_fingerprint", model_fingerprint)
    return prefix + model_fingerprint.encode("ascii") + b"/"


def hash_tokens(token_ids: Sequence[int], namespace: str = "") -> str:
    """Content address of a chunk: blake2b-128 of its token ids as int32 LE, in hex.

    Hashing token ids rather than text means two documents that tokenize to
    the same ids share one cached KV blob, and a tokenizer change (different
    ids) can never hit a stale entry. A non-empty ``namespace`` (a tenant) is hashed
    first, length-prefixed: the same tokens in two namespaces get unrelated addresses,
    so one namespace cannot learn from a cache hit what another holds.
    """
    ids = [operator.index(t) for t in token_ids]  # rejects floats instead of truncating
    if any(t < _INT32_MIN or t > _INT32_MAX for t in ids):
        raise ValueError("token ids must fit in int32")
    digest = hashlib.blake2b(digest_size=16)
    if namespace:
        encoded = namespace.encode("utf-8")
        digest.update(struct.pack("<I", len(encoded)) + encoded)
    digest.update(struct.pack(f"<{len(ids)}i", *ids))
    return digest.hexdigest()
