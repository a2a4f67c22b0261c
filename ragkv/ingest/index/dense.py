"""One tenant's dense (embedding) index: float32 rows it owns, an HNSW graph over them once
the tenant is large enough that the graph beats a scan, and a snapshot file.

Rows are appended as documents arrive; a removed document's rows become holes (skipped,
and dropped from the graph) until holes outnumber live rows, when the rows are compacted
(amortised: each compaction follows as many removals as rows it keeps). Scores are always
exact (the graph only proposes candidates, rescored from the float32 rows), and equal
scores rank by (document id, chunk index), as the registry's contract asks.

Adding to a graph costs far more than appending a row, so a document that arrives once the
graph exists is searchable at once and enters the graph later: its rows wait past the
graph's frontier (`_indexed`), where every search scans them exactly, while a background
thread inserts them a few at a time (each insertion holds the index's lock only briefly,
so a search waits at most for one). Every change and search takes that lock.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ragkv.ingest.index.ann import Graph, GraphConfig

SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class DenseConfig:
    exact_below: int = 10_000
    """Live rows under which search scans every row (as fast as the graph there, and exact)."""
    oversample: int = 2
    """A graph search asks for this many times top_k (more for a filter), rescored exactly."""
    graph: GraphConfig = field(default_factory=GraphConfig)
    background_insert: bool = True
    """Insert a new document's rows into the graph on a background thread (searches scan
    them exactly until then); False: inside `add_document`."""
    insert_batch: int = 1
    """Rows the background thread inserts per hold of the index's lock: a search waits for
    at most this many graph inserts."""

    def __post_init__(self) -> None:
        if self.exact_below < 0 or self.oversample < 1 or self.insert_batch < 1:
            raise ValueError("exact_below must be >= 0, oversample >= 1 and insert_batch >= 1")


def _scores(rows: np.ndarray, query: np.ndarray) -> np.ndarray:
    """rows @ query on this thread: einsum, not BLAS, whose worker threads must be woken for
    a matrix-vector product and, on a busy machine, wait for a time slice each query."""
    return np.einsum("ij,j->i", rows, query)


@dataclass(frozen=True)
class DenseHit:
    doc_id: str
    chunk_index: int
    score: float


class DenseIndex:
    def __init__(self, dim: int, config: DenseConfig = DenseConfig(), generation: int = 0):
        self.dim = dim
        self.config = config
        self.generation = generation
        """The registry generation whose documents the index holds."""
        self._vectors = np.zeros((0, dim), dtype=np.float32)
        self._doc = np.zeros(0, dtype=np.int32)  # row -> document slot; -1: a hole
        self._chunk = np.zeros(0, dtype=np.int32)
        self._size = 0  # rows used (live and holes)
        self._live = 0
        self._docs: list[str | None] = []  # slot -> doc_id (None: freed)
        self._slot: dict[str, int] = {}
        self._rows: dict[str, np.ndarray] = {}
        self.metadata: dict[str, dict] = {}
        self._graph: Graph | None = None
        self._indexed = 0  # rows below this are in the graph (or holes); the rest wait for it
        self._lock = threading.RLock()
        self._inserter: threading.Thread | None = None

    # -- size -------------------------------------------------------------------------

    @property
    def live(self) -> int:
        """Rows of the documents the index holds (holes not counted)."""
        return self._live

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._slot

    def doc_ids(self) -> list[str]:
        return list(self._slot)

    def chunks_of(self, doc_id: str) -> int:
        rows = self._rows.get(doc_id)
        return 0 if rows is None else len(rows)

    @property
    def uses_graph(self) -> bool:
        return self._graph is not None

    @property
    def pending(self) -> int:
        """Live rows that wait to enter the graph (searched exactly meanwhile)."""
        with self._lock:
            if self._graph is None:
                return 0
            return int(np.count_nonzero(self._doc[self._indexed : self._size] >= 0))

    def set_expansion_search(self, expansion: int) -> None:
        """The graph's search expansion (HNSW's ef) from now on: recall against time."""
        with self._lock:
            if self._graph is not None:
                self._graph.set_expansion_search(expansion)

    # -- changes ----------------------------------------------------------------------

    def add_document(self, doc_id: str, metadata: dict, vectors: np.ndarray) -> None:
        """Add (or replace) a document's rows, one per chunk in chunk order. Searchable on
        return; with a graph, its rows enter the graph in the background (see the module)."""
        with self._lock:
            self.remove_document(doc_id)
            self._append(doc_id, metadata, vectors)
            if self._graph is None:
                if self._wants_graph():
                    self._build_graph()
            elif self.config.background_insert:
                self._start_inserter()
            else:
                self.flush()

    def remove_document(self, doc_id: str) -> bool:
        with self._lock:
            slot = self._slot.pop(doc_id, None)
            if slot is None:
                return False
            rows = self._rows.pop(doc_id)
            self.metadata.pop(doc_id, None)
            self._docs[slot] = None
            self._doc[rows] = -1
            self._live -= len(rows)
            if self._graph is not None:
                self._graph.remove(rows[rows < self._indexed])  # the others never entered it
                if self._live < self.config.exact_below // 2:
                    self._graph = None  # small again: a scan is faster
            if self._size - self._live > max(self._live, 1024):
                self._compact()
            return True

    def flush(self, threads: int | None = None) -> None:
        """Insert every waiting row into the graph now (snapshots, benchmarks, tests)."""
        with self._lock:
            if self._graph is None:
                return
            rows = np.arange(self._indexed, self._size)
            rows = rows[self._doc[rows] >= 0]
            if len(rows):
                self._graph.add(rows, self._vectors[rows], threads=threads or os.cpu_count() or 1)
            self._indexed = self._size

    def wait_indexed(self) -> None:
        """Block until the background thread has put every waiting row into the graph."""
        while True:
            inserter = self._inserter
            if inserter is None:
                return
            inserter.join()

    def _start_inserter(self) -> None:
        if self._inserter is None and self._indexed < self._size:
            self._inserter = threading.Thread(target=self._insert_waiting, name="ragkv-graph-insert", daemon=True)
            self._inserter.start()

    def _insert_waiting(self) -> None:
        """The background thread: a few rows per hold of the lock until none wait; it ends
        then (a later add starts another), so an index that is dropped leaves no thread."""
        while True:
            with self._lock:
                if self._graph is None or self._indexed >= self._size:
                    self._inserter = None
                    return
                end = min(self._indexed + self.config.insert_batch, self._size)
                rows = np.arange(self._indexed, end)
                rows = rows[self._doc[rows] >= 0]
                if len(rows):
                    self._graph.add(rows, self._vectors[rows], threads=1)
                self._indexed = end

    def _wants_graph(self) -> bool:
        return self.config.exact_below > 0 and self._live >= self.config.exact_below

    def _append(self, doc_id: str, metadata: dict, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bookkeeping of a new document's rows (the graph is the caller's)."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if self._size == 0 and vectors.ndim == 2 and vectors.shape[1] != self.dim:
            self.dim, self._vectors = vectors.shape[1], np.zeros((0, vectors.shape[1]), dtype=np.float32)
        vectors = vectors.reshape(-1, self.dim)
        count = len(vectors)
        self._reserve(self._size + count)
        rows = np.arange(self._size, self._size + count)
        self._slot[doc_id] = len(self._docs)
        self._docs.append(doc_id)
        self._rows[doc_id] = rows
        self.metadata[doc_id] = metadata
        self._vectors[rows] = vectors
        self._doc[rows] = self._slot[doc_id]
        self._chunk[rows] = np.arange(count)
        self._size += count
        self._live += count
        return rows, vectors

    def _reserve(self, rows: int) -> None:
        if rows <= len(self._vectors):
            return
        capacity = max(rows, 2 * len(self._vectors), 1024)
        for name in ("_vectors", "_doc", "_chunk"):
            old = getattr(self, name)
            grown = np.zeros((capacity, *old.shape[1:]), dtype=old.dtype)
            grown[: self._size] = old[: self._size]
            setattr(self, name, grown)

    def _compact(self) -> None:
        """Drop the holes: rows renumbered, the graph rebuilt over them (with every row:
        a background thread that wakes up afterwards finds nothing waiting)."""
        documents = [(doc, self.metadata[doc], self._vectors[self._rows[doc]]) for doc in self._slot]
        fresh = DenseIndex.build(self.dim, documents, self.config, self.generation)
        del fresh.__dict__["_lock"], fresh.__dict__["_inserter"]  # this index's own stay
        self.__dict__.update(fresh.__dict__)

    def _build_graph(self, threads: int | None = None) -> None:
        live = np.flatnonzero(self._doc[: self._size] >= 0)
        graph = Graph(self.dim, self.config.graph)
        if len(live):
            graph.add(live, self._vectors[live], threads=threads or os.cpu_count() or 1)
        self._graph = graph
        self._indexed = self._size

    @classmethod
    def build(cls, dim: int, documents, config: DenseConfig = DenseConfig(), generation: int = 0) -> DenseIndex:
        """An index of (doc_id, metadata, vectors) documents, its graph built once at the end."""
        index = cls(dim, config, generation)
        for doc_id, metadata, vectors in documents:
            index.remove_document(doc_id)
            index._append(doc_id, metadata, vectors)
        if index._wants_graph():
            index._build_graph()
        return index

    # -- search -----------------------------------------------------------------------

    def search(self, query: np.ndarray, top_k: int, allowed: set[str] | None = None) -> list[DenseHit]:
        """The top_k rows by inner product (cosine on unit vectors), only rows of `allowed`
        documents when given: the filter is part of the search, so k hits come back
        whenever the allowed documents hold k chunks."""
        with self._lock:
            if top_k < 1 or not self._slot:
                return []
            return self._search(np.ascontiguousarray(query, dtype=np.float32).reshape(self.dim), top_k, allowed)

    def _search(self, query: np.ndarray, top_k: int, allowed: set[str] | None) -> list[DenseHit]:
        if allowed is not None:
            docs = [doc for doc in allowed if doc in self._rows]
            if not docs:
                return []
            candidates = np.concatenate([self._rows[doc] for doc in docs])
            if self._graph is None or len(candidates) <= self.config.exact_below:
                return self._exact(query, top_k, candidates)
            return self._graph_search(query, top_k, candidates)
        if self._graph is None:
            return self._exact(query, top_k, None)
        return self._graph_search(query, top_k, None)

    def _exact(self, query: np.ndarray, top_k: int, rows: np.ndarray | None) -> list[DenseHit]:
        if rows is None:
            scores = _scores(self._vectors[: self._size], query)
            scores[self._doc[: self._size] < 0] = -np.inf
            rows = np.arange(self._size)
        else:
            scores = _scores(self._vectors[rows], query)
        return self._rank(rows, scores, top_k)

    def _graph_search(self, query: np.ndarray, top_k: int, allowed_rows: np.ndarray | None) -> list[DenseHit]:
        live = self._live
        share = 1.0 if allowed_rows is None else len(allowed_rows) / max(live, 1)
        count = int(np.ceil(top_k * self.config.oversample / share))
        mask = None
        if allowed_rows is not None:
            mask = np.zeros(self._size, dtype=bool)
            mask[allowed_rows] = True
        waiting = np.arange(self._indexed, self._size)  # not in the graph yet: scanned
        waiting = waiting[self._doc[waiting] >= 0]
        in_graph = max(live - len(waiting), 1)
        if mask is not None:
            waiting = waiting[mask[waiting]]
        while True:
            found = self._graph.search(query, min(count, in_graph))
            found = found[(found >= 0) & (found < self._indexed)]
            found = found[self._doc[found] >= 0]
            if mask is not None:
                found = found[mask[found]]
            found = np.concatenate([found, waiting])
            if len(found) >= top_k or count >= in_graph:
                break
            count *= 4  # too few of the filter's rows near the query: look wider
        if len(found) < top_k:
            return self._exact(query, top_k, allowed_rows)
        return self._rank(found, _scores(self._vectors[found], query), top_k)

    def _rank(self, rows: np.ndarray, scores: np.ndarray, top_k: int) -> list[DenseHit]:
        finite = np.isfinite(scores)
        if not finite.all():
            rows, scores = rows[finite], scores[finite]
        if len(rows) > top_k:
            kth = np.partition(scores, len(scores) - top_k)[len(scores) - top_k]
            keep = scores >= kth  # ties at the cut stay, so the order below decides them
            rows, scores = rows[keep], scores[keep]
        hits = [
            DenseHit(self._docs[self._doc[row]], int(self._chunk[row]), float(score))
            for row, score in zip(rows.tolist(), scores.tolist())
        ]
        hits.sort(key=lambda hit: (-hit.score, hit.doc_id, hit.chunk_index))
        return hits[:top_k]

    # -- snapshot ---------------------------------------------------------------------

    def save(self, path: Path, identity: str) -> None:
        """Write the index to `path` atomically (a temporary file renamed over it), every
        waiting row put into the graph first."""
        with self._lock:
            self.flush()
            self._save(path, identity)

    def _save(self, path: Path, identity: str) -> None:
        live_docs = [doc for doc in self._docs if doc is not None]
        meta = {
            "version": SNAPSHOT_VERSION,
            "identity": identity,
            "generation": self.generation,
            "dim": self.dim,
            "docs": live_docs,
            "metadata": [self.metadata[doc] for doc in live_docs],
            "graph": self._graph is not None,
        }
        rows = [self._rows[doc] for doc in live_docs]
        counts = np.asarray([len(r) for r in rows], dtype=np.int64)
        vectors = self._vectors[np.concatenate(rows)] if rows else np.zeros((0, self.dim), dtype=np.float32)
        meta_bytes = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        arrays = {"meta": meta_bytes, "counts": counts, "vectors": vectors}
        # The graph's keys are row numbers: it is reusable only when the rows have no holes.
        if self._graph is not None and self._size == len(vectors):
            arrays["graph"] = self._graph.to_bytes()
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: Path, identity: str, config: DenseConfig = DenseConfig()) -> DenseIndex | None:
        """The snapshot at `path`, or None when there is none usable (missing, unreadable,
        another registry's or another format's): the caller rebuilds."""
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(data["meta"].tobytes())
                if meta.get("version") != SNAPSHOT_VERSION or meta.get("identity") != identity:
                    return None
                counts, vectors = data["counts"], data["vectors"]
                graph = data["graph"] if "graph" in data.files else None
        except (OSError, ValueError, KeyError, EOFError):
            return None
        bounds = np.concatenate([[0], np.cumsum(counts)])
        index = cls(int(meta["dim"]), config, int(meta["generation"]))
        for i, (doc_id, metadata) in enumerate(zip(meta["docs"], meta["metadata"])):
            index._append(doc_id, metadata, vectors[bounds[i] : bounds[i + 1]])
        if index._wants_graph():
            try:
                if graph is None:
                    raise ValueError("no graph in the snapshot")
                index._graph = Graph.from_bytes(index.dim, graph, config.graph)
                index._indexed = index._size
            except (RuntimeError, ValueError):
                index._build_graph()
        return index
