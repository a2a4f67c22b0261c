"""The registry in a Redis server, so replicas on several hosts share one corpus.

Unlike the chunk store (a cache that may lose anything), this is the corpus itself:
give it a Redis that never evicts (`maxmemory-policy noeviction`) and persists
(AOF or RDB). Every key starts with `prefix` (default `ragkv:registry:`):

  {prefix}docs:{tenant}     hash  doc_id    -> JSON document record
  {prefix}texts:{tenant}    hash  doc_id    -> the document's UTF-8 text
  {prefix}bytext:{tenant}   hash  text_hash -> doc_id
  {prefix}vectors:{tenant}  hash  doc_id    -> the document's chunk embeddings (see _pack)
  {prefix}gen:{tenant}      int   the tenant's generation
  {prefix}changes:{tenant}  stream entry id {generation}-0, field doc -> the doc_id changed
  {prefix}refs              hash  chunk_hash -> number of documents that use the chunk

Add, remove and replace are Lua scripts, so each is atomic on the server, the change stream's entry
included. A replica's vector index follows the stream from the last generation it applied
(XRANGE, then one HGET per changed document); only a missing index, or one further behind
than the stream keeps, reads the whole vectors hash (with its generation, in one MULTI).
Each search costs one GET of the generation.

On a Redis Cluster (redis+cluster://...) the per-tenant keys carry the tenant as a hash
tag, `{prefix}docs:{{tenant}}` and so on, so each script and transaction stays in one slot
and tenants spread over the masters. The chunk reference counts are per tenant there too
(`{prefix}refs:{{tenant}}`, which the scripts update beside the tenant's documents), and
`refcount` sums them over the tenants listed in `{prefix}tenants`.
"""

from __future__ import annotations

import struct
from urllib.parse import urlsplit

import numpy as np

from ragkv.ingest.errors import NotFoundError, RegistryUnavailableError
from ragkv.ingest.registry import CHANGE_LOG_KEEP, DocumentRecord, DocumentRegistry
from ragkv.store.redis_client import (
    ERRORS,
    SCHEMES,
    hash_tag,
    is_cluster_url,
    redis_client,
    where,
)

DEFAULT_PREFIX = "ragkv:registry:"

# KEYS: docs texts bytext vectors refs gen changes; ARGV: doc_id record text text_hash vectors chunk_hash...
_ADD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[4], ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[5])
for i = 6, #ARGV do redis.call('HINCRBY', KEYS[5], ARGV[i], 1) end
local generation = redis.call('INCR', KEYS[6])
redis.call('XADD', KEYS[7], 'MAXLEN', '~', '%d', generation .. '-0', 'doc', ARGV[1])
return 1
"""

# KEYS as for _ADD; ARGV: doc_id, the record as read, its text_hash, its chunk hashes...
# Deletes only if the record is still the one read (else false: the caller reads again);
# the caller parses the record, so Lua never decodes JSON it may not accept.
_REMOVE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[3])
redis.call('HDEL', KEYS[4], ARGV[1])
local orphans = {}
for i = 4, #ARGV do
  if redis.call('HINCRBY', KEYS[5], ARGV[i], -1) <= 0 then
    redis.call('HDEL', KEYS[5], ARGV[i])
    table.insert(orphans, ARGV[i])
  end
end
local generation = redis.call('INCR', KEYS[6])
redis.call('XADD', KEYS[7], 'MAXLEN', '~', '%d', generation .. '-0', 'doc', ARGV[1])
return orphans
"""

# KEYS as for _ADD; ARGV: doc_id, the old record as read, its text_hash, the new record, text,
# text_hash, vectors, the number n of old chunk hashes, the n old hashes, then the new ones.
# The new references are counted before the old are dropped, so a chunk both versions use
# never reaches zero; like _REMOVE it returns false when the record changed since it was read.
_REPLACE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return false end
redis.call('HDEL', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[5])
redis.call('HSET', KEYS[3], ARGV[6], ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[7])
local n = tonumber(ARGV[8])
for i = 9 + n, #ARGV do redis.call('HINCRBY', KEYS[5], ARGV[i], 1) end
local orphans = {}
for i = 9, 8 + n do
  if redis.call('HINCRBY', KEYS[5], ARGV[i], -1) <= 0 then
    redis.call('HDEL', KEYS[5], ARGV[i])
    table.insert(orphans, ARGV[i])
  end
end
local generation = redis.call('INCR', KEYS[6])
redis.call('XADD', KEYS[7], 'MAXLEN', '~', '%d', generation .. '-0', 'doc', ARGV[1])
return orphans
"""

_HEADER = struct.Struct("<II")  # rows, dim


def _pack(indices: list[int], embeddings: np.ndarray) -> bytes:
    """rows, dim (uint32), then the chunk indices (int32), then the float32 rows."""
    rows, dim = embeddings.shape
    return _HEADER.pack(rows, dim) + np.asarray(indices, dtype="<i4").tobytes() + embeddings.astype("<f4").tobytes()


def _unpack(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    rows, dim = _HEADER.unpack_from(blob)
    indices = np.frombuffer(blob, dtype="<i4", count=rows, offset=_HEADER.size)
    matrix = np.frombuffer(blob, dtype="<f4", count=rows * dim, offset=_HEADER.size + 4 * rows).reshape(rows, dim)
    return indices, matrix


class RedisDocumentRegistry(DocumentRegistry):
    backend = "redis"

    def __init__(
        self, url: str, *, prefix: str = DEFAULT_PREFIX, connect_timeout_s: float = 2.0, op_timeout_s: float = 10.0
    ):
        super().__init__()
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(
                f"RedisDocumentRegistry needs a redis://, rediss://, unix:// or redis+cluster:// URL; got {parts.scheme}://..."
            )
        self.cluster = is_cluster_url(url)
        if self.cluster and ("{" in prefix or "}" in prefix):
            raise ValueError("on a Redis Cluster the registry's key prefix must not contain braces (hash tags)")
        self.where = where(url)
        self.prefix = prefix
        # One retry on a dropped connection: a server restart costs one reconnect, not an error.
        self._client = redis_client(url, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s, retries=1)
        self._add_script = self._client.register_script(_ADD % CHANGE_LOG_KEEP)
        self._remove_script = self._client.register_script(_REMOVE % CHANGE_LOG_KEEP)
        self._replace_script = self._client.register_script(_REPLACE % CHANGE_LOG_KEEP)
        self._call(self._client.ping)

    def _keys(self, tenant: str) -> list[str]:
        p = self.prefix
        if self.cluster:  # one slot per tenant: the scripts and the MULTI below touch these keys together
            t = hash_tag(tenant)
            return [
                f"{p}docs:{t}",
                f"{p}texts:{t}",
                f"{p}bytext:{t}",
                f"{p}vectors:{t}",
                f"{p}refs:{t}",
                f"{p}gen:{t}",
                f"{p}changes:{t}",
            ]
        return [
            f"{p}docs:{tenant}",
            f"{p}texts:{tenant}",
            f"{p}bytext:{tenant}",
            f"{p}vectors:{tenant}",
            f"{p}refs",
            f"{p}gen:{tenant}",
            f"{p}changes:{tenant}",
        ]

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ERRORS as error:
            raise RegistryUnavailableError(f"the document registry at redis {self.where} failed: {error}") from error

    # -- reads -----------------------------------------------------------------------

    def find_by_text(self, tenant: str, text_hash: str) -> str | None:
        raw = self._call(self._client.hget, self._keys(tenant)[2], text_hash)
        return raw.decode() if raw is not None else None

    def get(self, tenant: str, doc_id: str) -> DocumentRecord:
        raw = self._call(self._client.hget, self._keys(tenant)[0], doc_id)
        if raw is None:
            raise NotFoundError(f"no document {doc_id!r}")
        return DocumentRecord.from_json(raw)

    def text(self, tenant: str, doc_id: str) -> str:
        raw = self._call(self._client.hget, self._keys(tenant)[1], doc_id)
        if raw is None:
            raise NotFoundError(f"no document {doc_id!r}")
        return raw.decode()

    def list(self, tenant: str) -> list[DocumentRecord]:
        records = [DocumentRecord.from_json(raw) for raw in self._call(self._client.hvals, self._keys(tenant)[0])]
        return sorted(records, key=lambda record: record.created)

    def refcount(self, chunk_hash: str) -> int:
        if self.cluster:
            tenants = self._call(self._client.smembers, f"{self.prefix}tenants")
            return sum(int(self._call(self._client.hget, self._keys(t.decode())[4], chunk_hash) or 0) for t in tenants)
        raw = self._call(self._client.hget, f"{self.prefix}refs", chunk_hash)
        return int(raw) if raw is not None else 0

    def generation(self, tenant: str) -> int:
        raw = self._call(self._client.get, self._keys(tenant)[5])
        return int(raw) if raw is not None else 0

    # -- writes ----------------------------------------------------------------------

    def _add(self, record: DocumentRecord, text: str, embeddings: np.ndarray) -> bool:
        vectors = _pack([chunk.index for chunk in record.chunks], embeddings)
        hashes = sorted({chunk.chunk_hash for chunk in record.chunks})
        args = [record.doc_id, record.to_json(), text.encode(), record.text_hash, vectors, *hashes]
        if self.cluster:  # listed before its first reference exists, so refcount never misses it
            self._call(self._client.sadd, f"{self.prefix}tenants", record.tenant)
        return bool(self._call(self._add_script, keys=self._keys(record.tenant), args=args))

    def remove(self, tenant: str, doc_id: str) -> tuple[DocumentRecord, list[str]]:
        keys = self._keys(tenant)
        while True:
            raw = self._call(self._client.hget, keys[0], doc_id)
            if raw is None:
                raise NotFoundError(f"no document {doc_id!r}")
            record = DocumentRecord.from_json(raw)
            hashes = sorted({chunk.chunk_hash for chunk in record.chunks})
            orphans = self._call(self._remove_script, keys=keys, args=[doc_id, raw, record.text_hash, *hashes])
            if orphans is not None:  # None: removed by someone else since it was read
                released = sorted(hash_.decode() for hash_ in orphans)
                if self.cluster:  # the script saw this tenant's counts only: another may still use a chunk
                    released = [hash_ for hash_ in released if self.refcount(hash_) == 0]
                return record, released

    def _replace(self, record: DocumentRecord, text: str, embeddings: np.ndarray) -> tuple[DocumentRecord, list[str]]:
        keys = self._keys(record.tenant)
        vectors = _pack([chunk.index for chunk in record.chunks], embeddings)
        new_hashes = sorted({chunk.chunk_hash for chunk in record.chunks})
        while True:
            raw = self._call(self._client.hget, keys[0], record.doc_id)
            if raw is None:
                raise NotFoundError(f"no document {record.doc_id!r}")
            old = DocumentRecord.from_json(raw)
            old_hashes = sorted({chunk.chunk_hash for chunk in old.chunks})
            args = [
                record.doc_id,
                raw,
                old.text_hash,
                record.to_json(),
                text.encode(),
                record.text_hash,
                vectors,
                len(old_hashes),
                *old_hashes,
                *new_hashes,
            ]
            orphans = self._call(self._replace_script, keys=keys, args=args)
            if orphans is not None:  # None: changed by someone else since it was read
                released = sorted(hash_.decode() for hash_ in orphans)
                if self.cluster:  # the script saw this tenant's counts only: another may still use a chunk
                    released = [hash_ for hash_ in released if self.refcount(hash_) == 0]
                return old, released

    def identity(self) -> str:
        return f"redis:{self.where}#{self.prefix}"

    def close(self) -> None:
        self.close_index()
        self._client.close()

    def healthy(self) -> bool:
        try:
            if self.cluster:  # every master: each holds some tenants' corpus
                return bool(self._client.ping(target_nodes=self._client.PRIMARIES))
            return bool(self._client.ping())
        except ERRORS:
            return False

    # -- retrieval -------------------------------------------------------------------

    def changes(self, tenant: str, after: int) -> list[tuple[int, str]]:
        entries = self._call(self._client.xrange, self._keys(tenant)[6], min=f"{after + 1}-0")
        return [(int(entry_id.split(b"-")[0]), fields[b"doc"].decode()) for entry_id, fields in entries]

    def document_vectors(self, tenant: str, doc_id: str) -> tuple[DocumentRecord, np.ndarray] | None:
        keys = self._keys(tenant)
        pipe = self._client.pipeline(transaction=True)
        pipe.hget(keys[0], doc_id)
        pipe.hget(keys[3], doc_id)
        raw_record, blob = self._call(pipe.execute)
        if raw_record is None or blob is None:
            return None
        indices, matrix = _unpack(blob)
        return DocumentRecord.from_json(raw_record), matrix[np.argsort(indices, kind="stable")]

    def _embeddings(self, tenant: str) -> tuple[int, list[tuple[str, int]], np.ndarray]:
        keys = self._keys(tenant)
        pipe = self._client.pipeline(transaction=True)
        pipe.get(keys[5])
        pipe.hgetall(keys[3])
        raw_generation, blobs = self._call(pipe.execute)
        owners, parts = [], []
        for doc_id in sorted(blobs, key=lambda doc: doc + b"/"):  # the LMDB backend's key order
            indices, matrix = _unpack(blobs[doc_id])
            order = np.argsort(indices, kind="stable")
            owners += [(doc_id.decode(), int(indices[i])) for i in order]
            parts.append(matrix[order])
        matrix = np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32)
        return int(raw_generation or 0), owners, matrix
