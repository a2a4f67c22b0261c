"""The DocumentRegistry contract, run unchanged against every backend: a real LMDB file and a real
redis-server. Two registry objects on one backend stand for two replicas (separate
processes: separate embedding caches)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from redis.cluster import RedisCluster

from ragkv.ingest.errors import NotFoundError, RegistryUnavailableError
from ragkv.ingest.registry import ChunkRecord, DocumentRecord, DocumentRegistry
from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
from ragkv.ingest.registry_url import open_registry
from ragkv.store.errors import StoreError
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.redis_client import redis_client


@pytest.fixture(
    params=["lmdb", pytest.param("redis", marks=pytest.mark.redis), pytest.param("cluster", marks=pytest.mark.redis)]
)
def replicas(request: pytest.FixtureRequest, tmp_path):
    """Two registries over one backend, as two replicas would open it."""
    if request.param == "lmdb":
        env = LMDBEnvironment(tmp_path / "db")
        opened: list[DocumentRegistry] = [LMDBDocumentRegistry(env), LMDBDocumentRegistry(env)]
    else:
        url = request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
        client = redis_client(url, connect_timeout_s=2, op_timeout_s=5)
        client.flushdb(**({"target_nodes": RedisCluster.PRIMARIES} if request.param == "cluster" else {}))
        client.close()
        opened = [open_registry(url, env=None), open_registry(url, env=None)]
    yield opened
    for registry in opened:
        registry.close()
    if request.param == "lmdb":
        env.close()


@pytest.fixture
def registry(replicas) -> DocumentRegistry:
    return replicas[0]


def document(
    doc_id: str, chunk_hashes: list[str], tenant: str = "t", created: float | None = None, metadata: dict | None = None
) -> DocumentRecord:
    chunks = [ChunkRecord(i, h, i * 4, i * 4 + 4, i * 10, i * 10 + 10) for i, h in enumerate(chunk_hashes)]
    return DocumentRecord(
        doc_id,
        tenant,
        f"{doc_id}.txt",
        f"hash-{doc_id}",
        4 * len(chunks),
        4,
        "fp",
        time.time() if created is None else created,
        chunks,
        metadata or {},
    )


def unit_rows(*directions: int, dim: int = 4) -> np.ndarray:
    return np.eye(dim, dtype=np.float32)[list(directions)]


def test_add_then_read_back_everything(registry):
    record = document("doc_a", ["h1", "h2"], metadata={"lang": "fr", "note": "é ✓"})
    assert registry.add(record, "texte complet ✓", unit_rows(0, 1)) is True
    assert registry.get("t", "doc_a") == record
    assert registry.text("t", "doc_a") == "texte complet ✓"
    assert registry.find_by_text("t", "hash-doc_a") == "doc_a"
    assert [r.doc_id for r in registry.list("t")] == ["doc_a"]
    assert registry.refcount("h1") == registry.refcount("h2") == 1


def test_any_record_the_json_holds_round_trips_and_removes(registry):
    record = document("doc_a", ["h1"], metadata={"lone": "\udfff", "emoji": "😀", "deep": {"n": [1, 2.5e300, None]}})
    registry.add(record, "a", unit_rows(0))
    assert registry.get("t", "doc_a") == record
    removed, orphans = registry.remove("t", "doc_a")
    assert removed == record and orphans == ["h1"] and registry.list("t") == []


def test_unknown_ids_are_not_found(registry):
    with pytest.raises(NotFoundError):
        registry.get("t", "doc_missing")
    with pytest.raises(NotFoundError):
        registry.text("t", "doc_missing")
    with pytest.raises(NotFoundError):
        registry.remove("t", "doc_missing")
    assert registry.find_by_text("t", "nothing") is None
    assert registry.list("t") == [] and registry.refcount("h") == 0
    assert registry.search("t", np.ones(4, dtype=np.float32), 3) == []


def test_list_is_oldest_first(registry):
    for doc_id, created in (("doc_b", 30.0), ("doc_a", 20.0), ("doc_c", 10.0)):
        registry.add(document(doc_id, [doc_id + "-h"], created=created), doc_id, unit_rows(0))
    assert [r.doc_id for r in registry.list("t")] == ["doc_c", "doc_a", "doc_b"]


def test_tenants_see_only_their_documents(registry):
    registry.add(document("doc_a", ["h1"], tenant="alice"), "a", unit_rows(0))
    assert registry.list("bob") == [] and registry.find_by_text("bob", "hash-doc_a") is None
    with pytest.raises(NotFoundError):
        registry.get("bob", "doc_a")
    with pytest.raises(NotFoundError):
        registry.remove("bob", "doc_a")
    assert registry.search("bob", unit_rows(0)[0], 5) == []
    assert [hit.doc_id for hit in registry.search("alice", unit_rows(0)[0], 5)] == ["doc_a"]


def test_shared_chunks_are_counted_once_per_document_and_orphaned_last(registry):
    registry.add(document("doc_a", ["h1", "h2", "h1"]), "a", unit_rows(0, 1, 2))  # h1 repeats inside
    registry.add(document("doc_b", ["h2", "h3"]), "b", unit_rows(1, 2))
    assert [registry.refcount(h) for h in ("h1", "h2", "h3")] == [1, 2, 1]
    removed, orphans = registry.remove("t", "doc_a")
    assert removed.doc_id == "doc_a" and sorted(orphans) == ["h1"]
    assert [registry.refcount(h) for h in ("h1", "h2", "h3")] == [0, 1, 1]
    _, orphans = registry.remove("t", "doc_b")
    assert sorted(orphans) == ["h2", "h3"]
    assert registry.list("t") == [] and registry.find_by_text("t", "hash-doc_b") is None
    with pytest.raises(NotFoundError):
        registry.text("t", "doc_b")


def test_adding_an_existing_document_changes_nothing(registry):
    assert registry.add(document("doc_a", ["h1"]), "first", unit_rows(0)) is True
    assert registry.add(document("doc_a", ["h1"]), "second", unit_rows(1)) is False
    assert registry.text("t", "doc_a") == "first" and registry.refcount("h1") == 1
    assert registry.search("t", unit_rows(0)[0], 5)[0].score == pytest.approx(1.0)


def test_embeddings_must_match_the_chunks(registry):
    with pytest.raises(ValueError, match="one embedding per chunk"):
        registry.add(document("doc_a", ["h1", "h2"]), "a", unit_rows(0))
    assert registry.list("t") == [] and registry.refcount("h1") == 0


def test_search_ranks_by_cosine_against_a_numpy_reference(registry):
    rng = np.random.default_rng(0)
    vectors = {}
    for d in range(5):
        rows = rng.standard_normal((3, 8)).astype(np.float32)
        rows /= np.linalg.norm(rows, axis=1, keepdims=True)
        vectors[f"doc_{d}"] = rows
        registry.add(document(f"doc_{d}", [f"h{d}{i}" for i in range(3)]), "x", rows)
    query = rng.standard_normal(8).astype(np.float32)
    owners = [(doc, i) for doc in sorted(vectors) for i in range(3)]
    scores = np.concatenate([vectors[doc] for doc in sorted(vectors)]) @ query
    expected = [(owners[i], float(scores[i])) for i in np.argsort(-scores, kind="stable")[:4]]
    hits = registry.search("t", query, 4)
    assert [((h.doc_id, h.chunk_index), h.score) for h in hits] == [
        (o, pytest.approx(s, abs=1e-6)) for o, s in expected
    ]
    restricted = registry.search("t", query, 10, doc_ids={"doc_1", "doc_3"})
    assert {h.doc_id for h in restricted} == {"doc_1", "doc_3"} and len(restricted) == 6


def test_equal_scores_rank_by_document_then_chunk(registry):
    registry.add(document("doc_b", ["h1", "h2"]), "b", unit_rows(0, 0))
    registry.add(document("doc_a", ["h3"]), "a", unit_rows(0))
    hits = registry.search("t", unit_rows(0)[0], 3)
    assert [(h.doc_id, h.chunk_index) for h in hits] == [("doc_a", 0), ("doc_b", 0), ("doc_b", 1)]


def test_another_replica_sees_adds_and_removes(replicas):
    replica_a, replica_b = replicas
    query = unit_rows(1)[0]
    replica_a.add(document("doc_1", ["h1"]), "one", unit_rows(0))
    assert [h.doc_id for h in replica_b.search("t", query, 5)] == ["doc_1"]  # B caches the matrix now
    generation = replica_b.generation("t")
    replica_a.add(document("doc_2", ["h2"]), "two", unit_rows(1))
    assert replica_b.generation("t") != generation
    assert replica_b.search("t", query, 1)[0].doc_id == "doc_2"
    assert replica_b.text("t", "doc_2") == "two" and replica_b.refcount("h2") == 1
    replica_a.remove("t", "doc_2")
    assert [h.doc_id for h in replica_b.search("t", query, 5)] == ["doc_1"]


def test_concurrent_adds_of_one_document_count_its_chunks_once(replicas):
    barrier = threading.Barrier(8)
    results = []

    def add(registry: DocumentRegistry) -> None:
        barrier.wait()
        results.append(registry.add(document("doc_a", ["h1", "h2"]), "a", unit_rows(0, 1)))

    threads = [threading.Thread(target=add, args=(replicas[i % 2],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]
    assert replicas[0].refcount("h1") == replicas[1].refcount("h2") == 1


def test_concurrent_removes_of_one_document_release_its_chunks_once(replicas):
    replicas[0].add(document("doc_a", ["h1"]), "a", unit_rows(0))
    replicas[0].add(document("doc_b", ["h1"]), "b", unit_rows(0))
    barrier = threading.Barrier(8)
    outcomes = []

    def remove(registry: DocumentRegistry) -> None:
        barrier.wait()
        try:
            outcomes.append(registry.remove("t", "doc_a")[1])
        except NotFoundError:
            outcomes.append("not found")

    threads = [threading.Thread(target=remove, args=(replicas[i % 2],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes, key=str) == [[]] + ["not found"] * 7
    assert replicas[1].refcount("h1") == 1 and [r.doc_id for r in replicas[1].list("t")] == ["doc_b"]


def replaced(old: DocumentRecord, chunk_hashes: list[str]) -> DocumentRecord:
    """A new version of `old`: same id, other text hash and chunks."""
    version = document(old.doc_id, chunk_hashes, tenant=old.tenant)
    return DocumentRecord(**{**version.__dict__, "text_hash": old.text_hash + "-v2"})


def test_replace_swaps_versions_and_keeps_shared_chunks_referenced(replicas):
    replica_a, replica_b = replicas
    replica_a.add(document("doc_a", ["h1", "h2"]), "version one", unit_rows(0, 1))
    replica_a.add(document("doc_b", ["h2"]), "b", unit_rows(3))
    assert [h.doc_id for h in replica_b.search("t", unit_rows(0)[0], 1)] == ["doc_a"]  # B caches the matrix
    generation = replica_b.generation("t")
    new = replaced(replica_a.get("t", "doc_a"), ["h2", "h3", "h4"])
    old, orphans = replica_a.replace(new, "version two", unit_rows(2, 2, 1))
    assert old.chunks[0].chunk_hash == "h1" and orphans == ["h1"]  # h2 is in both versions (and doc_b)
    assert replica_b.generation("t") != generation
    assert replica_b.get("t", "doc_a") == new and replica_b.text("t", "doc_a") == "version two"
    assert replica_b.find_by_text("t", "hash-doc_a") is None and replica_b.find_by_text("t", "hash-doc_a-v2") == "doc_a"
    assert [replica_b.refcount(h) for h in ("h1", "h2", "h3", "h4")] == [0, 2, 1, 1]
    assert [r.doc_id for r in replica_b.list("t")] == ["doc_b", "doc_a"]
    # the old chunks left retrieval as the new ones entered: no row of version one remains
    hits = replica_b.search("t", unit_rows(0)[0], 10)
    assert all(h.score < 0.5 for h in hits if h.doc_id == "doc_a")
    top = replica_b.search("t", unit_rows(2)[0], 2)
    assert [(h.doc_id, h.chunk_index) for h in top] == [("doc_a", 0), ("doc_a", 1)]
    _, orphans = replica_b.remove("t", "doc_a")
    assert sorted(orphans) == ["h3", "h4"] and replica_b.refcount("h2") == 1


def test_replace_of_a_missing_document_or_bad_embeddings_changes_nothing(registry):
    with pytest.raises(NotFoundError):
        registry.replace(document("doc_missing", ["h1"]), "x", unit_rows(0))
    registry.add(document("doc_a", ["h1"]), "a", unit_rows(0))
    with pytest.raises(ValueError, match="one embedding per chunk"):
        registry.replace(replaced(registry.get("t", "doc_a"), ["h2", "h3"]), "b", unit_rows(0))
    with pytest.raises(NotFoundError):
        registry.replace(document("doc_a", ["h2"], tenant="other"), "x", unit_rows(0))
    assert registry.text("t", "doc_a") == "a" and registry.refcount("h1") == 1 and registry.refcount("h2") == 0
    assert registry.list("t") == [registry.get("t", "doc_a")]


def test_concurrent_replaces_leave_one_version_whole(replicas):
    replicas[0].add(document("doc_a", ["h0"]), "v0", unit_rows(0))
    barrier = threading.Barrier(6)

    def replace(i: int) -> None:
        barrier.wait()
        new = replaced(replicas[i % 2].get("t", "doc_a"), [f"h{i + 1}", "shared"])
        replicas[i % 2].replace(new, f"v{i + 1}", unit_rows(1, 2))

    threads = [threading.Thread(target=replace, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    record = replicas[1].get("t", "doc_a")
    winner = record.chunks[0].chunk_hash
    assert replicas[1].text("t", "doc_a") == f"v{winner[1:]}"
    counts = {h: replicas[1].refcount(h) for h in ["h0", "shared"] + [f"h{i + 1}" for i in range(6)]}
    assert counts == {h: int(h in (winner, "shared")) for h in counts}


# -- backend-specific: the Redis server going away, URLs --------------------------------------


@pytest.mark.redis
def test_redis_registry_down_is_a_store_error_and_recovers(killable_redis):
    registry = open_registry(killable_redis.url, env=None)
    registry.add(document("doc_a", ["h1"]), "a", unit_rows(0))
    killable_redis.stop()
    with pytest.raises(RegistryUnavailableError, match="registry at redis") as raised:
        registry.list("t")
    assert isinstance(raised.value, StoreError)
    with pytest.raises(RegistryUnavailableError):
        registry.add(document("doc_b", ["h2"]), "b", unit_rows(1))
    killable_redis.start()  # persistence is off in tests: the server comes back empty
    assert registry.list("t") == []
    registry.add(document("doc_b", ["h2"]), "b", unit_rows(1))
    assert [h.doc_id for h in registry.search("t", unit_rows(1)[0], 5)] == ["doc_b"]
    registry.close()


def test_unreachable_redis_registry_fails_at_open():
    with pytest.raises(RegistryUnavailableError, match="127.0.0.1:1"):
        open_registry("redis://127.0.0.1:1/0?connect_timeout=0.5", env=None)


@pytest.mark.redis
def test_redis_prefixes_keep_deployments_apart(redis_url):
    first = open_registry(redis_url + "?prefix=one:", env=None)
    second = open_registry(redis_url + "?prefix=two:", env=None)
    first.add(document("doc_a", ["h1"]), "a", unit_rows(0))
    assert second.list("t") == [] and second.refcount("h1") == 0
    first.remove("t", "doc_a")
    first.close()
    second.close()


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://host/x", "unknown registry URL scheme"),
        ("redis://127.0.0.1:1/0?ttl=5", "unknown parameter 'ttl'"),
        ("redis://127.0.0.1:1/0?timeout=-1", "timeout must be a positive"),
        ("redis://127.0.0.1:1/0?timeout=soon", "bad value 'soon'"),
        ("redis://127.0.0.1:1/0?prefix=", "prefix must not be empty"),
        ("redis://user:secret@127.0.0.1:1/0?ttl=1", r"\*\*\*"),
        ("lmdb:///", "expected lmdb:///abs/path"),
    ],
)
def test_bad_registry_urls_are_refused_with_a_message(url, message):
    with pytest.raises(ValueError, match=message) as raised:
        open_registry(url, env=None)
    assert "secret" not in str(raised.value)


def test_lmdb_registry_url_opens_its_own_environment(tmp_path):
    registry = open_registry(f"lmdb://{tmp_path}/registry", env=None)
    registry.add(document("doc_a", ["h1"]), "a", unit_rows(0))
    registry.close()
    reopened = open_registry(f"lmdb://{tmp_path}/registry", env=None)
    assert reopened.text("t", "doc_a") == "a"
    reopened.close()
