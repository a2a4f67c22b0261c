"""The retrieval index: dense search (HNSW graph and scan) against an exact numpy reference,
metadata filters inside the search, BM25 on SQLite FTS5, reciprocal rank fusion, the index
on disk (rebuilt when deleted, caught up from the change log when behind) and replicas on
one real redis-server following the change stream instead of re-reading every vector."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from ragkv.errors import InputError
from ragkv.ingest.index.bm25 import match_expression
from ragkv.ingest.index.dense import DenseConfig, DenseHit, DenseIndex
from ragkv.ingest.index.filters import MetadataFilter
from ragkv.ingest.index.hybrid import reciprocal_rank_fusion
from ragkv.ingest.registry import ChunkRecord, DocumentRecord
from ragkv.ingest.registry_url import open_registry
from ragkv.store.lmdb_env import LMDBEnvironment

DIM = 16


def unit(rng: np.random.Generator, rows: int, dim: int = DIM) -> np.ndarray:
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def document(
    doc_id: str, chunks: int, tenant: str = "t", metadata: dict | None = None, texts: list[str] | None = None
) -> tuple[DocumentRecord, str]:
    texts = texts or [f"{doc_id} chunk {i}." for i in range(chunks)]
    spans, text = [], ""
    for piece in texts:
        spans.append((len(text), len(text) + len(piece)))
        text += piece + " "
    records = [ChunkRecord(i, f"{tenant}-{doc_id}-{i}", i * 4, i * 4 + 4, *spans[i]) for i in range(chunks)]
    return DocumentRecord(
        doc_id, tenant, doc_id, f"hash-{doc_id}", 4 * chunks, 4, "fp", time.time(), records, metadata or {}
    ), text


def exact_top(vectors: dict[str, np.ndarray], query: np.ndarray, k: int, docs=None) -> list[tuple[str, int]]:
    owners = [(doc, i) for doc in sorted(vectors) if docs is None or doc in docs for i in range(len(vectors[doc]))]
    matrix = np.concatenate([vectors[doc] for doc, i in owners if i == 0]) if owners else np.zeros((0, DIM))
    scores = matrix @ query
    return [owners[i] for i in np.argsort(-scores, kind="stable")[:k]]


# -- the dense index against exact search ----------------------------------------------------


@pytest.mark.parametrize("exact_below", [0, 300])  # 0: always a scan; 300: the graph serves the large index
def test_dense_index_matches_exact_search_through_adds_and_removes(exact_below):
    rng = np.random.default_rng(1)
    index = DenseIndex(DIM, DenseConfig(exact_below=exact_below))
    vectors = {}
    for d in range(60):
        vectors[f"doc_{d:02d}"] = unit(rng, 10)
        index.add_document(f"doc_{d:02d}", {"n": d}, vectors[f"doc_{d:02d}"])
    for d in range(0, 60, 4):
        assert index.remove_document(f"doc_{d:02d}")
        del vectors[f"doc_{d:02d}"]
    assert index.uses_graph == (exact_below > 0) and index.live == 450
    recalls = []
    for query in unit(rng, 20):
        expected = exact_top(vectors, query, 10)
        got = [(hit.doc_id, hit.chunk_index) for hit in index.search(query, 10)]
        recalls.append(len(set(got) & set(expected)) / 10)
        if exact_below == 0:
            assert got == expected
    assert np.mean(recalls) >= 0.95


def test_dense_scores_are_exact_even_through_the_graph():
    rng = np.random.default_rng(2)
    index = DenseIndex(DIM, DenseConfig(exact_below=50))
    rows = unit(rng, 100)
    index.add_document("doc_a", {}, rows)
    query = unit(rng, 1)[0]
    for hit in index.search(query, 5):
        assert hit.score == pytest.approx(float(rows[hit.chunk_index] @ query), abs=1e-6)


@pytest.mark.parametrize("exact_below", [0, 200])
def test_a_filter_inside_the_search_still_returns_k_hits(exact_below):
    """A filter that keeps 3 of 100 documents: the graph alone would find few of their rows
    among its nearest, yet k hits come back, all from allowed documents, in exact order."""
    rng = np.random.default_rng(3)
    index = DenseIndex(DIM, DenseConfig(exact_below=exact_below))
    vectors = {f"doc_{d:03d}": unit(rng, 8) for d in range(100)}
    for doc, rows in vectors.items():
        index.add_document(doc, {}, rows)
    allowed = {"doc_007", "doc_042", "doc_099"}
    query = unit(rng, 1)[0]
    hits = index.search(query, 20, allowed)
    assert len(hits) == 20 and {hit.doc_id for hit in hits} <= allowed
    assert [(h.doc_id, h.chunk_index) for h in hits] == exact_top(vectors, query, 20, allowed)
    assert len(index.search(query, 50, allowed)) == 24  # only 24 exist


def test_rows_waiting_for_the_graph_are_searched_exactly(monkeypatch):
    """Once a graph exists, an added document is searchable before its rows enter the
    graph (they are scanned); a removed waiting document never reaches the graph, and a
    flush or a snapshot puts every waiting row in it."""
    rng = np.random.default_rng(5)
    index = DenseIndex(DIM, DenseConfig(exact_below=200))
    vectors = {f"doc_{d:02d}": unit(rng, 10) for d in range(30)}
    for doc, rows in vectors.items():
        index.add_document(doc, {}, rows)
    index.wait_indexed()
    assert index.uses_graph and index.pending == 0
    monkeypatch.setattr(index, "_start_inserter", lambda: None)  # the background thread held back
    for d in range(30, 36):
        vectors[f"doc_{d:02d}"] = unit(rng, 10)
        index.add_document(f"doc_{d:02d}", {}, vectors[f"doc_{d:02d}"])
    assert index.pending == 60 and len(index._graph) == 300
    for doc in ("doc_31", "doc_33"):
        index.remove_document(doc)
        del vectors[doc]
    assert index.pending == 40 and len(index._graph) == 300
    for query in [vectors["doc_34"][3], *unit(rng, 5)]:
        got = [(hit.doc_id, hit.chunk_index) for hit in index.search(query, 10)]
        expected = exact_top(vectors, query, 10)
        assert got[0] == expected[0] and len(set(got) & set(expected)) >= 9
    index.flush()
    assert index.pending == 0 and len(index._graph) == index.live == 340


def test_background_inserts_race_searches_and_removals():
    rng = np.random.default_rng(6)
    index = DenseIndex(DIM, DenseConfig(exact_below=100, insert_batch=1))
    vectors = {}
    for d in range(80):
        vectors[f"doc_{d:02d}"] = unit(rng, 10)
        index.add_document(f"doc_{d:02d}", {}, vectors[f"doc_{d:02d}"])
        if d % 3 == 0 and d:
            index.remove_document(f"doc_{d // 2:02d}")
            vectors.pop(f"doc_{d // 2:02d}", None)
        query = vectors[f"doc_{d:02d}"][0]
        assert index.search(query, 1)[0].doc_id == f"doc_{d:02d}"  # found at once, graph or not
    index.wait_indexed()
    assert index.pending == 0 and len(index._graph) == index.live
    query = unit(rng, 1)[0]
    expected = exact_top(vectors, query, 10)
    assert len({(h.doc_id, h.chunk_index) for h in index.search(query, 10)} & set(expected)) >= 9


def test_a_snapshot_holds_the_waiting_rows_in_its_graph(tmp_path, monkeypatch):
    rng = np.random.default_rng(7)
    index = DenseIndex(DIM, DenseConfig(exact_below=100))
    monkeypatch.setattr(index, "_start_inserter", lambda: None)
    for d in range(30):
        index.add_document(f"doc_{d}", {}, unit(rng, 5))
    assert index.pending > 0
    index.save(tmp_path / "t.dense.npz", "r")
    loaded = DenseIndex.load(tmp_path / "t.dense.npz", "r", DenseConfig(exact_below=100))
    assert loaded.pending == 0 and len(loaded._graph) == loaded.live == 150


def test_dense_snapshot_round_trips_and_refuses_another_registry(tmp_path):
    rng = np.random.default_rng(4)
    index = DenseIndex(DIM, DenseConfig(exact_below=100), generation=7)
    for d in range(30):
        index.add_document(f"doc_{d}", {"d": d}, unit(rng, 5))
    query = unit(rng, 1)[0]
    index.save(tmp_path / "t.dense.npz", "registry-1")
    loaded = DenseIndex.load(tmp_path / "t.dense.npz", "registry-1", DenseConfig(exact_below=100))
    assert loaded.generation == 7 and loaded.uses_graph and loaded.metadata["doc_3"] == {"d": 3}
    assert loaded.search(query, 10) == index.search(query, 10)
    assert DenseIndex.load(tmp_path / "t.dense.npz", "registry-2") is None
    (tmp_path / "broken.npz").write_bytes(b"not a zip")
    assert DenseIndex.load(tmp_path / "broken.npz", "registry-1") is None


# -- filters -----------------------------------------------------------------------------------


def test_filters_match_like_their_definition():
    meta = {"team": "legal", "year": 2021, "draft": True}
    assert MetadataFilter.parse({"team": "legal"}).matches(meta)
    assert not MetadataFilter.parse({"team": "hr"}).matches(meta)
    assert MetadataFilter.parse({"team": {"$in": ["hr", "legal"]}, "year": {"$gte": 2020, "$lt": 2022}}).matches(meta)
    assert not MetadataFilter.parse({"year": {"$gt": 2021}}).matches(meta)
    assert MetadataFilter.parse({"year": {"$lte": 2021}}).matches(meta)
    assert MetadataFilter.parse({"team": {"$ne": "hr"}, "missing": {"$ne": 1}}).matches(meta)
    assert not MetadataFilter.parse({"draft": 1}).matches(meta)  # a boolean is not the number 1
    assert not MetadataFilter.parse({"team": {"$gte": 1}}).matches(meta)  # a range never matches a string
    assert not MetadataFilter.parse({"absent": "x"}).matches(meta)
    assert MetadataFilter.from_pairs(["year=2021", "team=legal"]).matches(meta)
    assert MetadataFilter.from_pairs(["year=2021"]).matches({"year": "2021"})  # the CLI's text matches text too
    assert MetadataFilter.from_pairs(["team=hr", "team=legal"]).matches(meta)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({}, "non-empty JSON object"),
        ([1], "non-empty JSON object"),
        ({"$team": 1}, "metadata names"),
        ({"team": {"$regex": "x"}}, "unknown operator"),
        ({"team": {}}, "empty operator object"),
        ({"team": {"$in": []}}, r"\$in needs a list"),
        ({"team": {"$in": "legal"}}, r"\$in needs a list"),
        ({"year": {"$gte": "2020"}}, "needs a finite number"),
        ({"year": {"$lt": True}}, "needs a finite number"),
        ({"team": ["legal"]}, "must be a string, a finite number or a boolean"),
        ({"team": None}, "must be a string"),
    ],
)
def test_bad_filters_are_refused_with_a_message(raw, message):
    with pytest.raises(InputError, match=message) as raised:
        MetadataFilter.parse(raw)
    assert raised.value.reason == "bad_filter"


def test_cli_filter_pairs_need_an_equals_sign():
    with pytest.raises(InputError, match="key=value"):
        MetadataFilter.from_pairs(["team"])


# -- BM25 and fusion ---------------------------------------------------------------------------


def test_match_expression_quotes_every_word():
    assert match_expression('What is "AB-123" (NEAR)?') == '"what" OR "is" OR "ab" OR "123" OR "near"'
    assert match_expression("?!") is None


def test_reciprocal_rank_fusion_against_its_formula():
    dense = [DenseHit("a", 0, 0.9), DenseHit("b", 0, 0.8), DenseHit("c", 0, 0.7)]
    bm25 = [DenseHit("c", 0, 12.0), DenseHit("a", 0, 3.0)]
    fused = reciprocal_rank_fusion([dense, bm25], 3, rrf_k=60)
    expected = {"a": 1 / 61 + 1 / 62, "b": 1 / 62, "c": 1 / 63 + 1 / 61}
    assert [hit.doc_id for hit in fused] == sorted(expected, key=lambda d: -expected[d])
    assert [hit.score for hit in fused] == pytest.approx(sorted(expected.values(), reverse=True))


# -- through a registry: on disk, filters, BM25, tenants ---------------------------------------


@pytest.fixture
def lmdb_registry(tmp_path):
    env = LMDBEnvironment(tmp_path / "db")
    registry = open_registry(None, env, tmp_path / "index")
    yield registry
    registry.close()
    env.close()


def add(registry, rng, doc_id, chunks, tenant="t", metadata=None, texts=None) -> np.ndarray:
    record, text = document(doc_id, chunks, tenant, metadata, texts)
    vectors = unit(rng, chunks)
    assert registry.add(record, text, vectors)
    return vectors


def test_filtered_search_returns_k_hits_inside_the_filter_and_the_tenant(lmdb_registry):
    rng = np.random.default_rng(5)
    vectors = {}
    for d in range(40):
        team = "legal" if d % 10 == 0 else "eng"
        vectors[f"doc_{d:02d}"] = add(lmdb_registry, rng, f"doc_{d:02d}", 6, metadata={"team": team, "year": 2000 + d})
        add(lmdb_registry, rng, f"doc_{d:02d}", 6, tenant="other", metadata={"team": "legal", "year": 2000 + d})
    index = lmdb_registry.index
    allowed = index.allowed("t", MetadataFilter.parse({"team": "legal"}), None)
    assert allowed == {"doc_00", "doc_10", "doc_20", "doc_30"}
    query = unit(rng, 1)[0]
    for mode in ("dense", "hybrid", "bm25"):
        hits = index.search("t", mode, query, "doc_10 chunk", 10, allowed)
        assert len(hits) == 10 and {hit.doc_id for hit in hits} <= allowed, mode
    dense = index.search("t", "dense", query, "", 10, allowed)
    assert [(h.doc_id, h.chunk_index) for h in dense] == exact_top(vectors, query, 10, allowed)
    ranged = index.allowed("t", MetadataFilter.parse({"year": {"$gte": 2035}, "team": {"$in": ["eng"]}}), None)
    assert ranged == {f"doc_{d}" for d in range(35, 40)}
    # Only the tenant's own documents, whatever the filter: the other tenant's ids never come back.
    assert index.allowed("nobody", MetadataFilter.parse({"team": "legal"}), None) == set()
    assert lmdb_registry.index.search("nobody", "hybrid", query, "doc_10 chunk", 10, None) == []


def test_bm25_finds_an_exact_name_and_follows_removals(lmdb_registry):
    rng = np.random.default_rng(6)
    add(lmdb_registry, rng, "doc_a", 3, texts=["The quarterly report.", "Invoice XK-4471 was paid late.", "Nothing."])
    add(lmdb_registry, rng, "doc_b", 2, texts=["Another report.", "Invoice 9 was paid."])
    hits = lmdb_registry.index.search("t", "bm25", None, "who paid XK-4471?", 3, None)
    assert (hits[0].doc_id, hits[0].chunk_index) == ("doc_a", 1)
    lmdb_registry.remove("t", "doc_a")
    hits = lmdb_registry.index.search("t", "bm25", None, "XK-4471 invoice", 5, None)
    assert {hit.doc_id for hit in hits} == {"doc_b"}


def test_a_deleted_index_file_is_rebuilt_and_a_stale_one_catches_up(tmp_path):
    rng = np.random.default_rng(7)
    env = LMDBEnvironment(tmp_path / "db")
    registry = open_registry(None, env, tmp_path / "index")
    vectors = {f"doc_{d}": add(registry, rng, f"doc_{d}", 4) for d in range(10)}
    query = unit(rng, 1)[0]
    expected = registry.search("t", query, 8)
    registry.close()
    snapshot = next((tmp_path / "index").rglob("t.dense.npz"))

    snapshot.unlink()
    reopened = open_registry(None, env, tmp_path / "index")
    assert reopened.search("t", query, 8) == expected and reopened.index.stats.rebuilds == 1
    reopened.close()
    assert snapshot.exists()

    # A snapshot behind the registry: the log since then is applied, nothing rebuilt.
    writer = open_registry(None, env, None)
    vectors["doc_new"] = add(writer, rng, "doc_new", 4)
    writer.remove("t", "doc_3")
    del vectors["doc_3"]
    behind = open_registry(None, env, tmp_path / "index")
    hits = behind.search("t", query, 8)
    assert [(h.doc_id, h.chunk_index) for h in hits] == exact_top(vectors, query, 8)
    assert behind.index.stats.rebuilds == 0 and behind.index.stats.applied_changes == 2
    behind.close()
    writer.close()
    env.close()


def test_an_index_further_behind_than_the_log_rebuilds(tmp_path, monkeypatch):
    rng = np.random.default_rng(8)
    env = LMDBEnvironment(tmp_path / "db")
    registry = open_registry(None, env, tmp_path / "index")
    add(registry, rng, "doc_0", 2)
    registry.search("t", unit(rng, 1)[0], 1)
    registry.close()
    import ragkv.ingest.registry_lmdb as lmdb_module

    monkeypatch.setattr(lmdb_module, "CHANGE_LOG_KEEP", 2)  # the log now drops all but its last 2 entries
    writer = open_registry(None, env, None)
    for d in range(1, 5):
        add(writer, rng, f"doc_{d}", 2)
    behind = open_registry(None, env, tmp_path / "index")
    assert {h.doc_id for h in behind.search("t", unit(rng, 1)[0], 10)} == {f"doc_{d}" for d in range(5)}
    assert behind.index.stats.rebuilds == 1
    behind.close()
    writer.close()
    env.close()


# -- replicas on one Redis registry ------------------------------------------------------------


def _calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.mark.redis
def test_redis_replicas_follow_the_change_stream_without_rereading_every_vector(redis_url, tmp_path):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    rng = np.random.default_rng(9)
    replica_a = open_registry(redis_url, None, tmp_path / "a")
    replica_b = open_registry(redis_url, None, tmp_path / "b")
    vectors = {f"doc_{d}": add(replica_a, rng, f"doc_{d}", 5) for d in range(20)}
    query = unit(rng, 1)[0]
    assert [(h.doc_id, h.chunk_index) for h in replica_b.search("t", query, 5)] == exact_top(vectors, query, 5)
    assert replica_b.index.stats.rebuilds == 1  # its first search builds its index (one HGETALL)

    client.config_resetstat()
    vectors["doc_b1"] = add(replica_b, rng, "doc_b1", 5)  # each replica ingests...
    vectors["doc_a1"] = add(replica_a, rng, "doc_a1", 5)
    replica_a.remove("t", "doc_4")
    del vectors["doc_4"]
    for replica in (replica_a, replica_b):  # ...and each sees the other's documents
        assert [(h.doc_id, h.chunk_index) for h in replica.search("t", query, 10)] == exact_top(vectors, query, 10)
    # One HGETALL: replica A's first search building its index. B followed the stream
    # (one XRANGE) and read only the three documents that changed.
    assert _calls(client, "hgetall") == 1 and replica_a.index.stats.rebuilds == 1
    assert replica_b.index.stats.documents_read == 3 and replica_b.index.stats.rebuilds == 1
    assert _calls(client, "xrange") == 1

    client.config_resetstat()
    for _ in range(5):
        replica_b.search("t", query, 3)
    assert _calls(client, "hgetall") == 0 and _calls(client, "xrange") == 0  # current: one GET each
    replica_a.close()
    replica_b.close()
    client.close()


# -- wiring: the pipeline with the real embedder, the API's 400, the CLI's exit code ------------


def test_the_pipeline_retrieves_k_hits_inside_the_filter_and_the_tenant(lmdb_registry):
    from ragkv.app.rag import RagPipeline
    from ragkv.ingest.embedder import Embedder

    embedder = Embedder()
    topics = ["contract law and court rulings", "kernel scheduling and memory pages", "baking bread with sourdough"]
    for tenant in ("t", "other"):
        for d in range(12):
            texts = [f"Note {d}.{c} about {topics[d % 3]}." for c in range(3)]
            record, text = document(f"doc_{d:02d}", 3, tenant, {"team": ["legal", "eng", "food"][d % 3], "n": d}, texts)
            assert lmdb_registry.add(record, text, embedder.embed_passages(texts))
    rag = RagPipeline(None, None, lmdb_registry, embedder)
    legal = MetadataFilter.parse({"team": "legal", "n": {"$lt": 9}})  # doc_00, doc_03, doc_06: 9 chunks
    for mode in ("dense", "bm25", "hybrid"):  # (BM25 returns only chunks with a word of the question: "note")
        found = rag.retrieve("a note: how does the kernel schedule memory pages?", "t", 8, None, mode, legal)
        assert len(found) == 8, mode
        assert all(
            record.tenant == "t" and record.metadata["team"] == "legal" and record.metadata["n"] < 9
            for record, _, _ in found
        ), mode
    unfiltered = rag.retrieve("how does the kernel schedule memory pages?", "t", 3, None, "dense")
    assert {record.metadata["team"] for record, _, _ in unfiltered} == {"eng"}


def test_the_api_refuses_a_bad_filter_with_a_400():
    from ragkv.api.common.conversion import query_config
    from ragkv.api.config import ServeConfig
    from ragkv.api.errors import ApiError
    from ragkv.api.query.protocol import QueryRequest
    from ragkv.engine.generation import GenerationConfig

    request = QueryRequest(question="q", filter={"year": {"$gte": "2020"}})
    with pytest.raises(ApiError) as raised:
        query_config(request, GenerationConfig(), ServeConfig())
    assert (raised.value.status, raised.value.code, raised.value.param) == (400, "bad_filter", "filter")
    config = query_config(
        QueryRequest(question="q", filter={"team": "legal"}, retrieval="bm25"),
        GenerationConfig(),
        ServeConfig(retrieval="dense"),
    )
    assert config.retrieval == "bm25" and config.filter == MetadataFilter.parse({"team": "legal"})
    default = query_config(QueryRequest(question="q"), GenerationConfig(), ServeConfig(retrieval="dense"))
    assert default.retrieval == "dense"


def test_the_cli_refuses_a_bad_filter_before_loading_the_model(tmp_path, capsys, monkeypatch):
    from ragkv.app.runtime import Runtime
    from ragkv.cli.main import main

    def opened(*args, **kwargs):
        raise AssertionError("the model was loaded before the filter was checked")

    monkeypatch.setattr(Runtime, "__init__", opened)
    assert main(["ask", "q", "--filter", "no-equals-sign", "--data-dir", str(tmp_path)]) == 2
    assert "--filter expects key=value" in capsys.readouterr().err


def test_the_config_file_sets_the_retrieval_mode_of_ask_and_serve(tmp_path):
    from ragkv.cli.config_file import load_config
    from ragkv.cli.main import build_parser
    from ragkv.cli.serve import serve_config

    path = tmp_path / "ragkv.toml"
    path.write_text('retrieval = "bm25"\n[serve]\nretrieval = "dense"\n')
    ask = build_parser("ask", (path, load_config(path))).parse_args(["ask", "q"])
    assert ask.retrieval == "bm25"
    assert (
        build_parser("ask", (path, load_config(path))).parse_args(["ask", "q", "--retrieval", "hybrid"]).retrieval
        == "hybrid"
    )
    assert serve_config(build_parser("serve", (path, load_config(path))).parse_args(["serve"])).retrieval == "dense"
    path.write_text('[serve]\nretrieval = "sparse"\n')
    with pytest.raises((ValueError, SystemExit)):
        serve_config(build_parser("serve", (path, load_config(path))).parse_args(["serve"]))


def test_bench_retrieval_writes_the_figures_it_promises(tmp_path):
    import json

    from ragkv.cli.main import main

    out = tmp_path / "r.json"
    assert (
        main(["bench", "retrieval", "--chunks", "1000", "--queries", "10", "--exact-below", "400", "--json", str(out)])
        == 0
    )
    figures = json.loads(out.read_text())
    for key in (
        "chunks",
        "search_p50_ms",
        "search_p99_ms",
        "recall_at_10",
        "add_ms",
        "first_query_after_add_ms",
        "rss_mb",
        "delete_ms",
        "build_s",
    ):
        assert key in figures, key
    assert figures["chunks"] == 1000 and figures["uses_graph"] and figures["recall_at_10"] >= 0.9
    assert (
        main(["bench", "retrieval", "--chunks", "1000", "--queries", "10", "--exact-below", "0", "--json", str(out)])
        == 0
    )
    assert json.loads(out.read_text())["recall_at_10"] == 1.0  # the scan is the reference itself
