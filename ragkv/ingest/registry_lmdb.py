"""The registry in an LMDB environment (the embedded default: the data folder's, shared
with the chunks). Several processes on one host may share it; hosts may not.

Sub-databases (keys are UTF-8):
  documents   {tenant}/{doc_id}              -> JSON document record
  doc_by_text {tenant}/{text_hash}           -> doc_id (re-ingesting identical text reuses it)
  texts       {tenant}/{doc_id}              -> the document's UTF-8 text (citations, recompute)
  chunk_refs  {chunk_hash}                   -> number of documents that use the chunk
  embeddings  {tenant}/{doc_id}/{index:06d}  -> float32 embedding of one chunk
  registry_meta generation/{tenant}          -> the tenant's generation
  changes     {tenant}/{generation:012d}     -> doc_id the change touched (the vector index's log)

Each add/remove/replace is one write transaction, its change log entry included.
"""

from __future__ import annotations

import numpy as np

from ragkv.ingest.errors import NotFoundError
from ragkv.ingest.registry import CHANGE_LOG_KEEP, DocumentRecord, DocumentRegistry
from ragkv.store.lmdb_env import LMDBEnvironment


class LMDBDocumentRegistry(DocumentRegistry):
    """`env` stays the caller's unless `owns_env` (then `close` closes it)."""

    backend = "lmdb"

    def __init__(self, env: LMDBEnvironment, *, owns_env: bool = False):
        super().__init__()
        self.env = env
        self._owns_env = owns_env
        self._documents = env.db("documents")
        self._by_text = env.db("doc_by_text")
        self._texts = env.db("texts")
        self._refs = env.db("chunk_refs")
        self._vectors = env.db("embeddings")
        self._meta = env.db("registry_meta")
        self._changes = env.db("changes")

    # -- reads -----------------------------------------------------------------------

    def find_by_text(self, tenant: str, text_hash: str) -> str | None:
        with self.env.read() as txn:
            raw = txn.get(f"{tenant}/{text_hash}".encode(), db=self._by_text)
            return bytes(raw).decode() if raw is not None else None

    def get(self, tenant: str, doc_id: str) -> DocumentRecord:
        with self.env.read() as txn:
            raw = txn.get(f"{tenant}/{doc_id}".encode(), db=self._documents)
            if raw is None:
                raise NotFoundError(f"no document {doc_id!r}")
            return DocumentRecord.from_json(raw)

    def text(self, tenant: str, doc_id: str) -> str:
        with self.env.read() as txn:
            raw = txn.get(f"{tenant}/{doc_id}".encode(), db=self._texts)
            if raw is None:
                raise NotFoundError(f"no document {doc_id!r}")
            return bytes(raw).decode()

    def list(self, tenant: str) -> list[DocumentRecord]:
        with self.env.read() as txn:
            records = [DocumentRecord.from_json(value) for _, value in self._scan(txn, self._documents, tenant)]
        return sorted(records, key=lambda record: record.created)

    def refcount(self, chunk_hash: str) -> int:
        with self.env.read() as txn:
            raw = txn.get(chunk_hash.encode(), db=self._refs)
            return int(bytes(raw)) if raw is not None else 0

    def generation(self, tenant: str) -> int:
        with self.env.read() as txn:
            return self._generation(txn, tenant)

    # -- writes ----------------------------------------------------------------------

    def _add(self, record: DocumentRecord, text: str, embeddings: np.ndarray) -> bool:
        def write(txn) -> bool:
            key = f"{record.tenant}/{record.doc_id}".encode()
            if txn.get(key, db=self._documents) is not None:
                return False
            txn.put(key, record.to_json(), db=self._documents)
            txn.put(key, text.encode(), db=self._texts)
            txn.put(f"{record.tenant}/{record.text_hash}".encode(), record.doc_id.encode(), db=self._by_text)
            for chunk, vector in zip(record.chunks, embeddings):
                txn.put(
                    f"{record.tenant}/{record.doc_id}/{chunk.index:06d}".encode(), vector.tobytes(), db=self._vectors
                )
            for chunk_hash in {chunk.chunk_hash for chunk in record.chunks}:
                raw = txn.get(chunk_hash.encode(), db=self._refs)
                count = int(bytes(raw)) if raw is not None else 0
                txn.put(chunk_hash.encode(), str(count + 1).encode(), db=self._refs)
            self._bump_generation(txn, record.tenant, record.doc_id)
            return True

        return self.env.write(write)

    def remove(self, tenant: str, doc_id: str) -> tuple[DocumentRecord, list[str]]:
        def write(txn) -> tuple[DocumentRecord, list[str]]:
            key = f"{tenant}/{doc_id}".encode()
            raw = txn.get(key, db=self._documents)
            if raw is None:
                raise NotFoundError(f"no document {doc_id!r}")
            record = DocumentRecord.from_json(raw)
            txn.delete(key, db=self._documents)
            txn.delete(key, db=self._texts)
            txn.delete(f"{tenant}/{record.text_hash}".encode(), db=self._by_text)
            for chunk in record.chunks:
                txn.delete(f"{tenant}/{doc_id}/{chunk.index:06d}".encode(), db=self._vectors)
            orphans = self._count_refs(txn, [(h, -1) for h in {chunk.chunk_hash for chunk in record.chunks}])
            self._bump_generation(txn, tenant, doc_id)
            return record, orphans

        return self.env.write(write)

    def _replace(self, record: DocumentRecord, text: str, embeddings: np.ndarray) -> tuple[DocumentRecord, list[str]]:
        def write(txn) -> tuple[DocumentRecord, list[str]]:
            tenant, doc_id = record.tenant, record.doc_id
            key = f"{tenant}/{doc_id}".encode()
            raw = txn.get(key, db=self._documents)
            if raw is None:
                raise NotFoundError(f"no document {doc_id!r}")
            old = DocumentRecord.from_json(raw)
            txn.delete(f"{tenant}/{old.text_hash}".encode(), db=self._by_text)
            for chunk in old.chunks:
                txn.delete(f"{tenant}/{doc_id}/{chunk.index:06d}".encode(), db=self._vectors)
            txn.put(key, record.to_json(), db=self._documents)
            txn.put(key, text.encode(), db=self._texts)
            txn.put(f"{tenant}/{record.text_hash}".encode(), doc_id.encode(), db=self._by_text)
            for chunk, vector in zip(record.chunks, embeddings):
                txn.put(f"{tenant}/{doc_id}/{chunk.index:06d}".encode(), vector.tobytes(), db=self._vectors)
            old_hashes, new_hashes = {c.chunk_hash for c in old.chunks}, {c.chunk_hash for c in record.chunks}
            changes = [(h, 1) for h in new_hashes - old_hashes] + [(h, -1) for h in old_hashes - new_hashes]
            orphans = self._count_refs(txn, changes)
            self._bump_generation(txn, tenant, doc_id)
            return old, sorted(orphans)

        return self.env.write(write)

    def _count_refs(self, txn, changes: list[tuple[str, int]]) -> list[str]:
        """Apply (chunk_hash, +1/-1) reference changes in the caller's transaction; return the
        hashes no document uses any more."""
        orphans = []
        for chunk_hash, change in changes:
            raw_count = txn.get(chunk_hash.encode(), db=self._refs)
            count = (int(bytes(raw_count)) if raw_count is not None else 0) + change
            if count > 0:
                txn.put(chunk_hash.encode(), str(count).encode(), db=self._refs)
            else:
                txn.delete(chunk_hash.encode(), db=self._refs)
                orphans.append(chunk_hash)
        return orphans

    def identity(self) -> str:
        return f"lmdb:{self.env.path}"

    def close(self) -> None:
        self.close_index()
        if self._owns_env:
            self.env.close()

    # -- retrieval -------------------------------------------------------------------

    def _embeddings(self, tenant: str) -> tuple[int, list[tuple[str, int]], np.ndarray]:
        owners, vectors = [], []
        with self.env.read() as txn:
            generation = self._generation(txn, tenant)
            for key, value in self._scan(txn, self._vectors, tenant):
                _, doc_id, index = key.decode().rsplit("/", 2)
                owners.append((doc_id, int(index)))
                vectors.append(np.frombuffer(bytes(value), dtype=np.float32))
        matrix = np.stack(vectors) if vectors else np.zeros((0, 0), dtype=np.float32)
        return generation, owners, matrix

    @staticmethod
    def _scan(txn, db, tenant: str):
        """(key, value) of every entry under `{tenant}/`, in key order."""
        prefix = f"{tenant}/".encode()
        cursor = txn.cursor(db=db)
        if cursor.set_range(prefix):
            for key, value in cursor:
                key = bytes(key)
                if not key.startswith(prefix):
                    break
                yield key, value

    def _generation(self, txn, tenant: str) -> int:
        raw = txn.get(f"generation/{tenant}".encode(), db=self._meta)
        return int(bytes(raw)) if raw is not None else 0

    def _bump_generation(self, txn, tenant: str, doc_id: str) -> None:
        """Count a change of `doc_id` and log it, in the caller's transaction; the log keeps
        the last CHANGE_LOG_KEEP entries (an index further behind rebuilds)."""
        generation = self._generation(txn, tenant) + 1
        txn.put(f"generation/{tenant}".encode(), str(generation).encode(), db=self._meta)
        txn.put(f"{tenant}/{generation:012d}".encode(), doc_id.encode(), db=self._changes)
        if generation > CHANGE_LOG_KEEP:
            txn.delete(f"{tenant}/{generation - CHANGE_LOG_KEEP:012d}".encode(), db=self._changes)

    def changes(self, tenant: str, after: int) -> list[tuple[int, str]]:
        prefix = f"{tenant}/".encode()
        found = []
        with self.env.read() as txn:
            cursor = txn.cursor(db=self._changes)
            if cursor.set_range(prefix + f"{after + 1:012d}".encode()):
                for key, value in cursor:
                    key = bytes(key)
                    if not key.startswith(prefix):
                        break
                    found.append((int(key[len(prefix) :]), bytes(value).decode()))
        return found

    def document_vectors(self, tenant: str, doc_id: str) -> tuple[DocumentRecord, np.ndarray] | None:
        with self.env.read() as txn:
            raw = txn.get(f"{tenant}/{doc_id}".encode(), db=self._documents)
            if raw is None:
                return None
            record = DocumentRecord.from_json(raw)
            scan = self._scan(txn, self._vectors, f"{tenant}/{doc_id}")
            rows = [np.frombuffer(bytes(value), dtype=np.float32) for _, value in scan]
        return record, np.stack(rows)
