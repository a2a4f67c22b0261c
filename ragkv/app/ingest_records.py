"""Records of background ingestion tasks and their progress: what GET /v1/jobs/{id}
answers (the API calls them jobs).

Records are kept in the LMDB sub-database `jobs` of the data folder, with the id and
start time of the process running them, so they outlive it: a job whose process died
(kill -9, a crash, a restart) reads as failed ("interrupted") at the next start, not as
an unknown id. Progress is written at most once a second. Finished jobs are kept for
`keep_s` seconds (at most `max_finished`) so clients can read the result.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

from ragkv.ingest.processes import process_alive, process_start_time
from ragkv.store.lmdb_env import LMDBEnvironment

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
JOBS_DB = "jobs"
PROGRESS_WRITE_INTERVAL_S = 1.0
INTERRUPTED = {
    "code": "interrupted",
    "message": "the process running this job stopped before it finished; "
    "nothing of it was kept: submit the document again",
}


@dataclass
class IngestRecord:
    id: str
    tenant: str
    kind: str
    name: str
    status: str = QUEUED
    chunks_done: int = 0
    chunks_total: int | None = None
    result: dict | None = None
    error: dict | None = None
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    pid: int = field(default_factory=os.getpid)
    pid_start: str | None = field(default_factory=lambda: process_start_time(os.getpid()))

    @property
    def fraction(self) -> float | None:
        """The part of the chunks done; None while their number is unknown."""
        if self.status == SUCCEEDED:
            return 1.0
        return round(self.chunks_done / self.chunks_total, 4) if self.chunks_total else None

    @property
    def unfinished(self) -> bool:
        return self.status in (QUEUED, RUNNING)


class IngestRecords:
    def __init__(self, env: LMDBEnvironment, keep_s: float = 3600.0, max_finished: int = 1000):
        self.env = env
        self.keep_s = keep_s
        self.max_finished = max_finished
        self._db = env.db(JOBS_DB)
        self._jobs: dict[str, IngestRecord] = {}
        self._written: dict[str, float] = {}  # when each job's progress was last saved
        self._lock = threading.Lock()
        self._settle_interrupted()

    def create(self, tenant: str, kind: str, name: str) -> IngestRecord:
        record = IngestRecord("job_" + uuid.uuid4().hex[:20], tenant, kind, name)
        with self._lock:
            self._prune()
            self._jobs[record.id] = record
            self._save(record)
        return record

    def get(self, tenant: str, job_id: str) -> IngestRecord | None:
        with self._lock:
            record = self._jobs.get(job_id) or self._load(job_id)
        # Another tenant's job does not exist for this one.
        return record if record is not None and record.tenant == tenant else None

    def list(self, tenant: str) -> list[IngestRecord]:
        with self._lock:
            stored = {record.id: record for record in self._load_all() if record.tenant == tenant}
            stored.update({job_id: record for job_id, record in self._jobs.items() if record.tenant == tenant})
        return sorted(stored.values(), key=lambda record: record.created)

    def progress(self, record: IngestRecord, done: int, total: int) -> None:
        with self._lock:
            if record.status == QUEUED:
                record.status, record.started = RUNNING, time.time()
            record.chunks_done, record.chunks_total = done, total
            now = time.monotonic()
            if (
                record.id not in self._written
                or now - self._written[record.id] >= PROGRESS_WRITE_INTERVAL_S
                or done == total
            ):
                self._written[record.id] = now
                self._save(record)

    def start(self, record: IngestRecord) -> None:
        with self._lock:
            record.status, record.started = RUNNING, record.started or time.time()
            self._save(record)

    def finish(self, record: IngestRecord, status: str, result: dict | None = None, error: dict | None = None) -> None:
        with self._lock:
            record.status, record.result, record.error, record.finished = status, result, error, time.time()
            if status == SUCCEEDED and record.chunks_total is None:
                record.chunks_total = record.chunks_done
            self._save(record)

    def counts(self) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for record in self._jobs.values():
                counts[record.status] = counts.get(record.status, 0) + 1
            return counts

    # -- persistence (callers hold the lock) -------------------------------------------

    def _save(self, record: IngestRecord) -> None:
        raw = json.dumps(asdict(record)).encode()
        self.env.write(lambda txn: txn.put(record.id.encode(), raw, db=self._db))

    def _load(self, job_id: str) -> IngestRecord | None:
        with self.env.read() as txn:
            raw = txn.get(job_id.encode(), db=self._db)
            return None if raw is None else IngestRecord(**json.loads(bytes(raw)))

    def _load_all(self) -> list[IngestRecord]:
        with self.env.read() as txn:
            return [IngestRecord(**json.loads(bytes(value))) for _, value in txn.cursor(db=self._db)]

    def _settle_interrupted(self) -> None:
        with self._lock:
            for record in self._load_all():
                if record.unfinished and not process_alive(record.pid, record.pid_start):
                    record.status, record.error, record.finished = FAILED, INTERRUPTED, time.time()
                    self._save(record)
            self._prune()

    def _prune(self) -> None:
        cutoff = time.time() - self.keep_s
        finished = sorted((r for r in self._load_all() if r.finished is not None), key=lambda r: r.finished)
        excess = len(finished) - self.max_finished
        expired = [record.id for index, record in enumerate(finished) if record.finished < cutoff or index < excess]
        if expired:

            def delete(txn) -> None:
                for job_id in expired:
                    txn.delete(job_id.encode(), db=self._db)

            self.env.write(delete)
        for job_id in expired:
            self._jobs.pop(job_id, None)
            self._written.pop(job_id, None)
