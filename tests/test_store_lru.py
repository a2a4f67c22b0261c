"""ByteLRU: bounded by bytes, evicts least recently used."""

from __future__ import annotations

import pytest

from ragkv.store import ByteLRU


def test_evicts_least_recently_used_by_bytes() -> None:
    lru: ByteLRU[str, str] = ByteLRU(100)
    lru.put("a", "A", 40)
    lru.put("b", "B", 40)
    assert lru.get("a") == "A"  # now "b" is the oldest
    lru.put("c", "C", 40)
    assert "b" not in lru and lru.get("a") == "A" and lru.get("c") == "C"
    stats = lru.stats()
    assert (stats.entries, stats.bytes, stats.evictions, stats.hits) == (2, 80, 1, 3)


def test_replace_oversized_discard_and_disabled() -> None:
    lru: ByteLRU[str, str] = ByteLRU(100)
    lru.put("a", "A", 60)
    lru.put("a", "A2", 30)
    assert lru.get("a") == "A2" and lru.stats().bytes == 30
    lru.put("huge", "H", 101)
    assert "huge" not in lru and "a" in lru
    lru.discard("a")
    assert lru.get("a") is None and lru.stats().bytes == 0
    off: ByteLRU[str, str] = ByteLRU(0)
    off.put("a", "A", 1)
    assert off.get("a") is None
    with pytest.raises(ValueError):
        ByteLRU(-1)
    with pytest.raises(ValueError):
        lru.put("x", "X", -5)
