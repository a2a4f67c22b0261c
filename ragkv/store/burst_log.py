"""Log an outage once, not once per request.

A dead Redis would otherwise emit a warning for every lookup of every request.
:class:`BurstLog` logs the first failure of a burst, a reminder at most every
``reminder_s`` while it lasts, and one line when the backend recovers.
"""

from __future__ import annotations

import logging
import threading
import time


class BurstLog:
    def __init__(self, logger: logging.Logger, subject: str, *, reminder_s: float = 60.0) -> None:
        if reminder_s <= 0:
            raise ValueError("reminder_s must be positive")
        self._logger = logger
        self._subject = subject
        self._reminder_s = reminder_s
        self._lock = threading.Lock()
        self._failures = 0  # in the current burst; 0 = healthy
        self._last_logged = 0.0

    def failure(self, operation: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            first = self._failures == 1
            if not first and now - self._last_logged < self._reminder_s:
                return
            self._last_logged = now
            failures = self._failures
        if first:
            self._logger.warning(
                "%s unavailable (%s: %s: %s); treating as a cache miss, further errors suppressed",
                self._subject,
                operation,
                type(exc).__name__,
                exc,
            )
        else:
            self._logger.warning(
                "%s still unavailable: %d failed operations so far (last: %s: %s)",
                self._subject,
                failures,
                operation,
                exc,
            )

    def success(self) -> None:
        if not self._failures:  # unlocked fast path; the common case
            return
        with self._lock:
            failures, self._failures = self._failures, 0
        if failures:
            self._logger.warning("%s recovered after %d failed operations", self._subject, failures)
