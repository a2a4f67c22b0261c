"""Removing chunk blobs nothing references any more.

A blob is referenced while some document's record lists its chunk hash (the registry's
`chunk_refs`). Keys carry the model fingerprint, so one chunk hash can have a blob per
model that ever encoded it (ingestion by one model, recompute on a miss by another):
deleting a document removes every model's blob of its orphaned chunks.
"""

from __future__ import annotations

from ragkv.ingest.registry import DocumentRecord, Registry, check_tenant
from ragkv.store.base import ChunkStore
from ragkv.store.keys import KEY_NAMESPACE, ChunkKey


def blobs_of(store: ChunkStore, chunk_hashes: set[str]) -> list[ChunkKey]:
    """Every stored key (any model, any format version) of these chunk hashes."""
    if not chunk_hashes:
        return []
    return [key for key in store.iter_keys(KEY_NAMESPACE) if key.chunk_hash in chunk_hashes]


def delete_document(registry: Registry, store: ChunkStore, tenant: str, doc_id: str) -> DocumentRecord:
    """Unregister the document, then delete the blobs of chunks no other document uses."""
    record, orphans = registry.remove(check_tenant(tenant), doc_id)
    for key in blobs_of(store, set(orphans)):
        store.delete(key)
    return record
