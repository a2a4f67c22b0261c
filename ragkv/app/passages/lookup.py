"""The store reads of one prompt: which of its rows the chunk store holds, and the rows.

    round 1   get_many(the finder's span keys + the prompt's anchor keys)
              a span stored whole (ids compared) ─► its rows
              an anchor's record ─► the run that holds it, and where
    round 2   get_many(the runs those anchors name that round 1 did not bring)
              each anchor aligned with its run and extended token by token on both sides
              ─► the shared stretch's rows (longest first, overlaps cut away, >= min_match)

Two reads at most per prompt, whatever the store (LMDB, Redis, a tier of both). Nothing
here runs the model: the prefetch stage may call it on its own thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ragkv.app.passages.anchors import AnchorConfig, AnchorRecord, anchor_positions, extend
from ragkv.app.passages.keys import SpanKeys
from ragkv.app.passages.plan import PassagePlan, Placed
from ragkv.engine.kv_storage import KVStorageFormat, slice_tokens
from ragkv.store.base import ChunkStore

log = logging.getLogger("ragkv.app.passages")


@dataclass(frozen=True)
class _Match:
    """Prompt rows [start, end) equal to tokens [offset, offset + end - start) of a run."""

    start: int
    end: int
    run: str
    offset: int

    def __len__(self) -> int:
        return self.end - self.start

    def cut(self, start: int, end: int) -> _Match:
        return _Match(start, end, self.run, self.offset + start - self.start)


class PassageLookup:
    def __init__(self, keys: SpanKeys, store: ChunkStore, kv_format: KVStorageFormat, anchors: AnchorConfig):
        self.keys, self.store, self.kv_format, self.anchors = keys, store, kv_format, anchors

    def plan(self, tenant: str, token_ids: list[int], start: int) -> PassagePlan | None:
        """The passages in token_ids[start:] and the rows the store gives (None: none)."""
        found = self.keys.find(tenant, token_ids, start)
        ids = np.asarray(token_ids, dtype=np.int64)
        low, high = max(start, 1), len(token_ids) - 1  # a prefix row before, the last row after
        positions = self.anchor_positions(ids, low, high)
        chunk_keys = self.keys.chunk_keys
        window = self.anchors.window
        anchor_keys = [chunk_keys.anchor(tenant, token_ids[p - window + 1 : p + 1]) for p in positions]
        fetched = self.store.get_many(found.keys + anchor_keys) if found.keys or anchor_keys else []
        runs: dict[str, tuple[np.ndarray, dict]] = {}
        matches = []
        for span, digest, tensors in zip(found.spans, found.digests, fetched):
            tokens = _run_tokens(tensors)
            if tokens is not None and np.array_equal(tokens, ids[span.start : span.end]):
                runs[digest] = (tokens, tensors)
                matches.append(_Match(span.start, span.end, digest, 0))
        records = [(p, AnchorRecord.of(t)) for p, t in zip(positions, fetched[len(found.keys) :])]
        self._fetch_runs(tenant, {r.run for _, r in records if r is not None and r.run not in runs}, runs)
        matches += self._extend(ids, records, runs, low, high, matches)
        placed = self._placed(_disjoint(matches, self.anchors.min_match), runs)
        if not found.spans and not placed:
            return None
        return PassagePlan(found.spans, found.digests, placed, tenant)

    def anchor_positions(self, ids: np.ndarray, low: int, high: int) -> list[int]:
        """Anchor positions whose window lies in ids[low:high]."""
        window = self.anchors.window
        if high - low < window:
            return []
        return (anchor_positions(ids[low:high], self.anchors) + low).tolist()

    def _fetch_runs(self, tenant: str, digests: set[str], runs: dict[str, tuple[np.ndarray, dict]]) -> None:
        wanted = sorted(digests)
        if not wanted:
            return
        for digest, tensors in zip(wanted, self.store.get_many([self.keys.chunk_keys.key(tenant, d) for d in wanted])):
            tokens = _run_tokens(tensors)
            if tokens is not None:
                runs[digest] = (tokens, tensors)

    def _extend(self, ids, records, runs, low: int, high: int, known: list[_Match]) -> list[_Match]:
        """The stretches the anchors' runs share with the prompt (an anchor inside a stretch
        already found is not extended again)."""
        matches: list[_Match] = []
        reach = sorted((m.start, m.end) for m in known)
        for position, record in records:
            if record is None or record.run not in runs or _inside(position, reach, matches):
                continue
            tokens = runs[record.run][0]
            start, end = extend(ids, position, tokens, record.offset, low, high)
            if end - start >= self.anchors.min_match:
                matches.append(_Match(start, end, record.run, record.offset - (position - start)))
        return matches

    def _placed(self, matches: list[_Match], runs: dict[str, tuple[np.ndarray, dict]]) -> list[Placed]:
        placed, unpacked = [], {}
        for match in matches:
            if match.run not in unpacked:
                try:
                    unpacked[match.run] = self.kv_format.unpack(runs[match.run][1])
                except ValueError:
                    log.warning("a stored passage is in another format: recomputed")
                    unpacked[match.run] = None
            stored = unpacked[match.run]
            if stored is None:
                continue
            rows = (match.offset, match.offset + len(match))
            keys, values = (slice_tokens(part, *rows) for part in stored)
            placed.append(Placed(match.start, match.end, keys, values, match.run))
        return placed


def _run_tokens(tensors: dict | None) -> np.ndarray | None:
    if tensors is None or "tokens" not in tensors:
        return None
    return tensors["tokens"].numpy().astype(np.int64)


def _inside(position: int, known: list[tuple[int, int]], matches: list[_Match]) -> bool:
    return any(a <= position < b for a, b in known) or any(m.start <= position < m.end for m in matches[-4:])


def _disjoint(matches: list[_Match], min_match: int) -> list[_Match]:
    """The matches, longest first, each less what longer ones took (pieces of at least
    `min_match` kept), in prompt order."""
    taken: list[_Match] = []
    for match in sorted(matches, key=lambda m: (-len(m), m.start)):
        pieces = [(match.start, match.end)]
        for other in taken:
            pieces = [cut for a, b in pieces for cut in _minus(a, b, other.start, other.end)]
        taken += [match.cut(a, b) for a, b in pieces if b - a >= min_match]
    return sorted(taken, key=lambda m: m.start)


def _minus(a: int, b: int, c: int, d: int) -> list[tuple[int, int]]:
    """[a, b) less [c, d)."""
    if d <= a or b <= c:
        return [(a, b)]
    return [(x, y) for x, y in ((a, c), (d, b)) if y > x]
