"""Whether the process that wrote a durable record (an ingestion journal entry, a job)
is still running: its pid plus its start time, so a reused pid is not mistaken for it."""

from __future__ import annotations

import os
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (Linux); None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'


def process_start_time(pid: int) -> str | None:
    """When `pid` started (field 22, in clock ticks since boot); None without /proc."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def process_alive(pid: int, start_time: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    fields = _stat_fields(pid)
    if fields is None:
        return True  # it exists and nothing more can be told
    return fields[0] != "Z" and (start_time is None or fields[19] == start_time)
