"""Background ingestion jobs and their progress (GET /v1/jobs/{id}).

Jobs live in this process's memory: a replica answers only for the jobs it runs. Finished
jobs are kept for `keep_s` seconds (at most `max_finished`) so clients can read the result.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"


@dataclass
class JobRecord:
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

    def to_dict(self) -> dict:
        fraction = None
        if self.status == SUCCEEDED:
            fraction = 1.0
        elif self.chunks_total:
            fraction = round(self.chunks_done / self.chunks_total, 4)
        return {
            "id": self.id, "object": "job", "kind": self.kind, "name": self.name, "status": self.status,
            "progress": {"chunks_done": self.chunks_done, "chunks_total": self.chunks_total, "fraction": fraction},
            "result": self.result, "error": self.error, "created": self.created, "started": self.started,
            "finished": self.finished,
        }


class JobRegistry:
    def __init__(self, keep_s: float = 3600.0, max_finished: int = 1000):
        self.keep_s = keep_s
        self.max_finished = max_finished
        self._jobs: dict[str, JobRecord] = {}
        self._lock = threading.Lock()

    def create(self, tenant: str, kind: str, name: str) -> JobRecord:
        record = JobRecord("job_" + uuid.uuid4().hex[:20], tenant, kind, name)
        with self._lock:
            self._prune()
            self._jobs[record.id] = record
        return record

    def get(self, tenant: str, job_id: str) -> JobRecord | None:
        with self._lock:
            record = self._jobs.get(job_id)
        # Another tenant's job does not exist for this one.
        return record if record is not None and record.tenant == tenant else None

    def list(self, tenant: str) -> list[JobRecord]:
        with self._lock:
            return [record for record in self._jobs.values() if record.tenant == tenant]

    def progress(self, record: JobRecord, done: int, total: int) -> None:
        with self._lock:
            if record.status == QUEUED:
                record.status, record.started = RUNNING, time.time()
            record.chunks_done, record.chunks_total = done, total

    def start(self, record: JobRecord) -> None:
        with self._lock:
            record.status, record.started = RUNNING, record.started or time.time()

    def finish(self, record: JobRecord, status: str, result: dict | None = None, error: dict | None = None) -> None:
        with self._lock:
            record.status, record.result, record.error, record.finished = status, result, error, time.time()
            if status == SUCCEEDED and record.chunks_total is None:
                record.chunks_total = record.chunks_done

    def counts(self) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for record in self._jobs.values():
                counts[record.status] = counts.get(record.status, 0) + 1
            return counts

    def _prune(self) -> None:
        cutoff = time.time() - self.keep_s
        finished = sorted((r for r in self._jobs.values() if r.finished is not None), key=lambda r: r.finished)
        excess = len(finished) - self.max_finished
        for index, record in enumerate(finished):
            if record.finished < cutoff or index < excess:
                del self._jobs[record.id]
