"""What /metrics reports of prompt spans."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ragkv.app.passages.plan import PassagePlan


@dataclass
class SpanCounters:
    """Counted under a lock (the model thread and a store writer both add), read together."""

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    tokens_stored: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add_plan(self, plan: PassagePlan) -> None:
        with self._lock:
            self.hits += plan.hits
            self.misses += plan.misses
            self.tokens_reused += plan.reused_tokens

    def add_stored(self, tokens: int) -> None:
        with self._lock:
            self.tokens_stored += tokens

    def snapshot(self) -> SpanCounters:
        with self._lock:
            return SpanCounters(self.hits, self.misses, self.tokens_reused, self.tokens_stored)
