"""The ingestion journal: a durable note of the chunk blobs an ingestion is about to write.

An ingestion writes blobs one by one and makes the document visible in one registry
transaction at the end. If the process dies in between (kill -9, power loss), the blobs
it wrote are referenced by nothing. So before the first blob is written, the keys it
will write go into the LMDB sub-database `ingest_journal`, with the writing process's
id and start time; the entry is removed once the document is committed or rolled back.

At start-up (`reconcile`), entries whose process is gone are settled: each of their keys
whose chunk no document references is deleted from the store, then the entry. Entries of
live processes (another CLI or server on the same data folder) are left alone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from ragkv.ingest.processes import process_alive, process_start_time
from ragkv.store.base import ChunkStore
from ragkv.store.keys import ChunkKey
from ragkv.store.lmdb_env import LMDBEnvironment

log = logging.getLogger("ragkv.ingest")

JOURNAL_DB = "ingest_journal"


@dataclass(frozen=True)
class JournalEntry:
    id: str
    pid: int
    pid_start: str | None
    host: str
    created: float
    keys: list[ChunkKey]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "pid": self.pid,
                "pid_start": self.pid_start,
                "host": self.host,
                "created": self.created,
                "keys": [key.to_bytes().decode("ascii") for key in self.keys],
            }
        ).encode()

    @classmethod
    def from_json(cls, entry_id: str, raw: bytes) -> JournalEntry:
        data = json.loads(raw)
        keys = [ChunkKey.from_bytes(key.encode("ascii")) for key in data["keys"]]
        return cls(entry_id, data["pid"], data["pid_start"], data["host"], data["created"], keys)

    @property
    def writer_alive(self) -> bool:
        # Another host's process cannot be checked from here: treat it as alive.
        return self.host != socket.gethostname() or process_alive(self.pid, self.pid_start)


@dataclass(frozen=True)
class Reconciliation:
    entries: int
    """Journal entries of dead processes settled."""
    removed_blobs: int
    """Blobs of interrupted ingestions that no document references, deleted."""


class IngestJournal:
    def __init__(self, env: LMDBEnvironment):
        self.env = env
        self._db = env.db(JOURNAL_DB)

    def begin(self, keys: Iterable[ChunkKey]) -> str:
        """Note `keys` as about to be written; returns the entry id for `end`."""
        pid = os.getpid()
        entry = JournalEntry(
            "ing_" + uuid.uuid4().hex, pid, process_start_time(pid), socket.gethostname(), time.time(), list(keys)
        )
        self.env.write(lambda txn: txn.put(entry.id.encode(), entry.to_json(), db=self._db))
        return entry.id

    def end(self, entry_id: str) -> None:
        self.env.write(lambda txn: txn.delete(entry_id.encode(), db=self._db))

    def entries(self) -> list[JournalEntry]:
        with self.env.read() as txn:
            return [JournalEntry.from_json(bytes(key).decode(), bytes(value)) for key, value in txn.cursor(db=self._db)]

    def live_keys(self) -> set[bytes]:
        """Keys that ingestions still running may be writing (garbage collection spares them)."""
        return {key.to_bytes() for entry in self.entries() if entry.writer_alive for key in entry.keys}

    def reconcile(self, refcount, store: ChunkStore) -> Reconciliation:
        """Settle the entries of dead writers; `refcount(chunk_hash)` says whether a document
        references a chunk (the registry's)."""
        entries = self.entries()
        dead = [entry for entry in entries if not entry.writer_alive]
        if not dead:
            return Reconciliation(0, 0)
        spared = {key.to_bytes() for entry in entries if entry.writer_alive for key in entry.keys}
        removed = 0
        for entry in dead:
            for key in entry.keys:
                if key.to_bytes() not in spared and refcount(key.chunk_hash) == 0 and store.delete(key):
                    removed += 1
            self.end(entry.id)
        log.warning("settled %d interrupted ingestion(s): removed %d unreferenced chunk blob(s)", len(dead), removed)
        return Reconciliation(len(dead), removed)
