"""`ragkv bench retrieval`: the dense index at scale, and dense / BM25 / hybrid recall on a
question set with distractors.

Synthetic: `chunks` unit vectors of 384 dimensions drawn around cluster centres, one per 50
chunks by default, in 50-chunk documents (uniform random vectors at this dimension are all
nearly orthogonal, so their "nearest" neighbours are a tie no index can rank and no corpus
has). Real sentence embeddings cluster by topic, and related topics lie near each other: by
default the cluster centres are themselves drawn around topic centres (one per 5,000
chunks). `--topics 0` draws them independently instead ("flat"): with many clusters no two
are nearer than any other, a structure no graph index can route through (at 1M chunks,
20,000 unrelated clusters of 50) and no corpus has. Figures: search
p50/p99 of single queries, recall@10 against an exact scan, the time to add one 50-chunk
document and to delete it, the first query after the add, build time and resident memory.

Dev: every question's own passages among all the set's passages (each passage one
document); recall@k = the share of the k retrieved passages that are the question's own.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ragkv.ingest.index.dense import DenseConfig, DenseIndex
from ragkv.ingest.index.hybrid import RETRIEVAL_MODES

DOC_CHUNKS = 50


@dataclass(frozen=True)
class SyntheticConfig:
    chunks: int = 100_000
    dim: int = 384
    queries: int = 200
    centres: int | None = None
    """Clusters the vectors are drawn around; None: one per 50 chunks."""
    spread: float = 0.08
    """Noise around a centre, per dimension (relative to a centre's norm of about 1)."""
    topics: int | None = None
    """Topic centres the cluster centres are drawn around (None: one per 5,000 chunks); 0:
    flat, independent cluster centres."""
    topic_spread: float = 0.7
    """Norm of a cluster centre's offset from its topic's centre (a topic centre's norm is about 1)."""
    seed: int = 0
    top_k: int = 10
    adds: int = 5
    """50-chunk documents added one at a time, each followed by a query (medians reported)."""
    expansion_sweep: tuple[int, ...] = ()
    """Also recall@10 and search p50/p99 at these HNSW search expansions, on the same build."""
    dense: DenseConfig = field(default_factory=DenseConfig)

    def __post_init__(self) -> None:
        if self.chunks < DOC_CHUNKS or self.queries < 1 or self.dim < 2:
            raise ValueError(f"chunks must be >= {DOC_CHUNKS}, queries >= 1 and dim >= 2")


@dataclass
class SyntheticResult:
    chunks: int
    dim: int
    build_s: float
    search_p50_ms: float
    search_p99_ms: float
    recall_at_10: float
    add_ms: float
    """Adding one 50-chunk document (median of `adds`)."""
    first_query_after_add_ms: float
    """The query right after each add (median), while the document's rows enter the graph."""
    graph_insert_ms: float
    """From an add until its rows are all in the graph (median): background work after
    `add_ms`, during which searches scan those rows exactly."""
    delete_ms: float
    """Removing one of those documents again (median)."""
    exact_p50_ms: float
    """An exact scan of every row, for comparison."""
    rss_mb: float
    """The whole process: the index and the benchmark's own copy of the vectors."""
    uses_graph: bool
    machine: str = ""
    sweep: list[dict] = field(default_factory=list)
    """{expansion_search, recall_at_10, search_p50_ms, search_p99_ms} for each swept value."""


def _rss_mb() -> float:
    """Resident memory now (Linux /proc), else the peak (getrusage)."""
    try:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _unit_rows(rng: np.random.Generator, centres: np.ndarray, rows: int, spread: float) -> np.ndarray:
    out = centres[rng.integers(0, len(centres), rows)].copy()
    out += rng.standard_normal(out.shape, dtype=np.float32) * spread
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


def _percentiles(samples: list[float]) -> tuple[float, float]:
    return float(np.percentile(samples, 50)), float(np.percentile(samples, 99))


def run_synthetic(config: SyntheticConfig) -> SyntheticResult:
    rng = np.random.default_rng(config.seed)
    count = config.centres or max(config.chunks // DOC_CHUNKS, 1)
    centres = rng.standard_normal((count, config.dim), dtype=np.float32) / np.sqrt(config.dim)
    topics = max(config.chunks // 5000, 1) if config.topics is None else config.topics
    if topics > 0:  # each cluster centre near one topic's centre
        tops = rng.standard_normal((topics, config.dim), dtype=np.float32) / np.sqrt(config.dim)
        centres = tops[rng.integers(0, topics, count)] + centres * config.topic_spread
    documents = config.chunks // DOC_CHUNKS
    vectors = np.empty((documents * DOC_CHUNKS, config.dim), dtype=np.float32)
    for start in range(0, len(vectors), 100_000):  # bounded temporaries
        vectors[start : start + 100_000] = _unit_rows(rng, centres, min(100_000, len(vectors) - start), config.spread)
    queries = _unit_rows(rng, centres, config.queries, config.spread)
    extra = [_unit_rows(rng, centres, DOC_CHUNKS, config.spread) for _ in range(config.adds)]

    started = time.perf_counter()
    index = DenseIndex.build(
        config.dim,
        ((f"doc_{d:07d}", {}, vectors[d * DOC_CHUNKS : (d + 1) * DOC_CHUNKS]) for d in range(documents)),
        config.dense,
    )
    build_s = time.perf_counter() - started

    def owner(row: int) -> tuple[str, int]:
        return f"doc_{row // DOC_CHUNKS:07d}", row % DOC_CHUNKS

    truths, exact_times = [], []
    for query in queries[: min(len(queries), 100)]:
        t0 = time.perf_counter()
        scores = np.einsum("ij,j->i", vectors, query)  # as the index scans (see dense._scores)
        truths.append({owner(int(row)) for row in np.argpartition(-scores, config.top_k)[: config.top_k]})
        exact_times.append((time.perf_counter() - t0) * 1e3)

    def measure() -> tuple[float, float, float]:
        """recall@k against the exact scan, search p50 and p99 ms."""
        recalls = []
        for query, truth in zip(queries, truths):
            found = {(hit.doc_id, hit.chunk_index) for hit in index.search(query, config.top_k)}
            recalls.append(len(found & truth) / config.top_k)
        times = []
        for query in queries:
            t0 = time.perf_counter()
            index.search(query, config.top_k)
            times.append((time.perf_counter() - t0) * 1e3)
        return (float(np.mean(recalls)), *_percentiles(times))

    recall, p50, p99 = measure()
    sweep = []
    if index.uses_graph:
        for expansion in config.expansion_sweep:
            index.set_expansion_search(expansion)
            swept = measure()
            sweep.append(
                {
                    "expansion_search": expansion,
                    "recall_at_10": round(swept[0], 4),
                    "search_p50_ms": round(swept[1], 3),
                    "search_p99_ms": round(swept[2], 3),
                }
            )
        index.set_expansion_search(config.dense.graph.expansion_search)

    adds, firsts, inserts, deletes = [], [], [], []
    for number, rows in enumerate(extra):
        t0 = time.perf_counter()
        index.add_document(f"new_{number}", {}, rows)
        adds.append((time.perf_counter() - t0) * 1e3)
        t1 = time.perf_counter()
        hits = index.search(rows[0], config.top_k)
        firsts.append((time.perf_counter() - t1) * 1e3)
        index.wait_indexed()
        inserts.append((time.perf_counter() - t0) * 1e3)
        if not hits or hits[0].doc_id != f"new_{number}":
            raise RuntimeError("the document just added is not the nearest to its own first chunk")
    for number in range(len(extra)):
        t0 = time.perf_counter()
        index.remove_document(f"new_{number}")
        deletes.append((time.perf_counter() - t0) * 1e3)
    add_ms, first_ms, insert_ms, delete_ms = (float(np.median(v)) for v in (adds, firsts, inserts, deletes))
    return SyntheticResult(
        len(vectors),
        config.dim,
        round(build_s, 2),
        round(p50, 3),
        round(p99, 3),
        round(recall, 4),
        round(add_ms, 2),
        round(first_ms, 3),
        round(insert_ms, 2),
        round(delete_ms, 3),
        round(float(np.median(exact_times)), 2),
        round(_rss_mb(), 1),
        index.uses_graph,
        sweep=sweep,
    )


# -- the dev set: dense vs BM25 vs hybrid -----------------------------------------------------


@dataclass
class DevResult:
    questions: int
    passages: int
    recall: dict[str, dict[str, float]]
    """mode -> {"at_5": ..., "at_10": ...}: share of retrieved passages that are the question's own."""
    dense_graph_recall_at_10: float
    """The HNSW graph (forced on, though 1,000 rows would be scanned) against an exact scan
    on the real embeddings."""
    search_ms: dict[str, float]
    """mode -> median ms per question (the query embedding not included)."""
    embed_s: float


def run_dev(path: Path, limit: int | None = None) -> DevResult:
    """The dev set through a real LMDB registry and its retrieval index (one passage per
    document), with the packaged embedder."""
    from ragkv.bench.datasets import load_examples
    from ragkv.ingest.embedder import Embedder
    from ragkv.ingest.registry import ChunkRecord, DocumentRecord
    from ragkv.ingest.registry_url import open_registry
    from ragkv.store.lmdb_env import LMDBEnvironment

    examples = load_examples(path, limit)
    passages, owners = [], []
    for number, example in enumerate(examples):
        for text in example.passages:
            passages.append(text.strip())
            owners.append(number)
    embedder = Embedder()
    started = time.perf_counter()
    vectors = embedder.embed_passages(passages)
    questions = embedder.embed_queries([example.question for example in examples])
    embed_s = time.perf_counter() - started
    recall: dict[str, dict[str, float]] = {}
    search_ms: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        env = LMDBEnvironment(Path(folder) / "db")
        registry = open_registry(None, env, Path(folder) / "index")
        for i, text in enumerate(passages):
            record = DocumentRecord(
                f"doc_{i:05d}",
                "dev",
                f"p{i}",
                f"h{i}",
                1,
                512,
                "dev",
                float(i),
                [ChunkRecord(0, f"c{i}", 0, 1, 0, len(text))],
                {"question": owners[i]},
            )
            registry.add(record, text, vectors[i : i + 1])
        index = registry.index
        for mode in RETRIEVAL_MODES:
            shares = {5: [], 10: []}
            times = []
            for number, example in enumerate(examples):
                t0 = time.perf_counter()
                hits = index.search("dev", mode, questions[number], example.question, 10, None)
                times.append((time.perf_counter() - t0) * 1e3)
                own = [owners[int(hit.doc_id[4:])] == number for hit in hits]
                for k in shares:
                    shares[k].append(sum(own[:k]) / k)
            recall[mode] = {f"at_{k}": round(float(np.mean(v)), 4) for k, v in shares.items()}
            search_ms[mode] = round(float(np.median(times)), 3)
        registry.close()
        env.close()
    graph = DenseIndex.build(
        vectors.shape[1],
        ((f"doc_{i:05d}", {}, vectors[i : i + 1]) for i in range(len(vectors))),
        DenseConfig(exact_below=1),
    )
    exact = DenseIndex.build(
        vectors.shape[1],
        ((f"doc_{i:05d}", {}, vectors[i : i + 1]) for i in range(len(vectors))),
        DenseConfig(exact_below=0),
    )
    graph_recall = np.mean(
        [len({h.doc_id for h in graph.search(q, 10)} & {h.doc_id for h in exact.search(q, 10)}) / 10 for q in questions]
    )
    return DevResult(len(examples), len(passages), recall, round(float(graph_recall), 4), search_ms, round(embed_s, 1))


def as_dict(result: SyntheticResult | DevResult) -> dict:
    return asdict(result)
