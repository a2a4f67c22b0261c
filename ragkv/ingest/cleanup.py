"""Removing chunk blobs nothing references any more.

A blob is referenced while some document's record lists its chunk hash (the registry's
`chunk_refs`). Keys carry the model fingerprint, so one chunk hash can have a blob per
model that ever encoded it (ingestion by one model, recompute on a miss by another):
deleting a document removes every model's blob of its orphaned chunks.

`collect_garbage` removes every unreferenced blob: what an interrupted ingestion left on
a store the journal could not reach, what older versions left behind. It spares the
keys of ingestions running now (the journal's live entries). The references it checks
are this registry's: every deployment writing to the store must share that registry
(one data folder, or the shared registry backend) or gc would take their blobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.registry import DocumentRecord, DocumentRegistry, check_tenant
from ragkv.store.base import ChunkStore
from ragkv.store.keys import KEY_NAMESPACE, ChunkKey


def blobs_of(store: ChunkStore, chunk_hashes: set[str]) -> list[ChunkKey]:
    """Every stored key (any model, any format version) of these chunk hashes."""
    if not chunk_hashes:
        return []
    return [key for key in store.iter_keys(KEY_NAMESPACE) if key.chunk_hash in chunk_hashes]


def delete_document(registry: DocumentRegistry, store: ChunkStore, tenant: str, doc_id: str) -> DocumentRecord:
    """Unregister the document, then delete the blobs of chunks no other document uses."""
    record, orphans = registry.remove(check_tenant(tenant), doc_id)
    for key in blobs_of(store, set(orphans)):
        store.delete(key)
    return record


@dataclass(frozen=True)
class GarbageReport:
    scanned: int
    """Chunk blobs looked at."""
    unreferenced: int
    """Blobs no document references (removed unless a dry run)."""
    bytes: int
    """Their stored size: freed, or that would be."""
    removed: int


def collect_garbage(
    registry: DocumentRegistry, store: ChunkStore, journal: IngestJournal, *, dry_run: bool = False
) -> GarbageReport:
    spared = journal.live_keys()
    scanned = unreferenced = removed = freed = 0
    for key in list(store.iter_keys(KEY_NAMESPACE)):
        scanned += 1
        if key.to_bytes() in spared or registry.refcount(key.chunk_hash) > 0:
            continue
        unreferenced += 1
        freed += store.blob_size(key) or 0
        if not dry_run and store.delete(key):
            removed += 1
    return GarbageReport(scanned, unreferenced, freed, removed)
