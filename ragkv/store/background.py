"""Background threads step aside for the model thread.

A server's model thread runs every torch op on an OpenMP pool as wide as the cores, so a
parallel region ends when its slowest thread does. A background thread that encodes and
writes blobs (a chat context published to Redis, new chunks written behind a request) takes
a core from that pool whenever it runs: each step it overlaps waits for the descheduled
worker, and a running answer's inter-token gap grows by about the background work's CPU
time (BENCHMARKS.md, the arrivals run). On Linux a thread has its own nice value, so such a
thread runs at a lower weight: it still gets idle CPU at once, and a share of a busy one.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICENESS = 10
"""Added to a background thread's nice value: at +10 the scheduler gives it about a tenth of
a core the model's threads also want, so its writes still end under load."""


def lower_this_thread(niceness: int = BACKGROUND_NICENESS) -> bool:
    """Raise the calling thread's nice value by `niceness` (Linux, where a thread has its
    own); False where the platform does not allow it."""
    if not hasattr(os, "setpriority"):  # not on Windows
        return False
    thread = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, current + niceness))
    except OSError as error:
        log.debug("could not lower the priority of thread %s: %s", thread, error)
        return False
    return True
