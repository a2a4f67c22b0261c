"""Ingestion end to end on a real LMDB environment with the packaged model and embedder:
chunking, reuse, deletion, bad input, and roll-back on failure."""

from __future__ import annotations

import pytest

from ragkv.engine.fingerprint import KV_FORMAT_VERSION
from ragkv.errors import InputError
from ragkv.ingest.chunker import chunk_document
from ragkv.ingest.cleanup import collect_garbage
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.errors import NotFoundError
from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.loaders import document_text
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
from ragkv.store.errors import StoreUnavailableError
from ragkv.store.keys import ChunkKey
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import LMDBStore
from ragkv.store.redis_store import RedisStore
from ragkv.store.tiered import TieredStore

UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"

LIGHTHOUSE = "Gull Point Light was first lit in 1851 and automated in 1987. " * 12
ORCHARD = "Linden Hill Orchard grows nineteen apple varieties on M9 rootstock. " * 12


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture
def make_ingestor(engine, embedder, tmp_path):
    """Ingestor(store=..., **IngestConfig fields) over an LMDB registry in tmp_path."""
    opened = []

    def make(store=None, **config):
        env = LMDBEnvironment(tmp_path / "db")
        store = store or LMDBStore(tmp_path / "db")
        opened.extend((store, env))
        config = {"chunk_tokens": 64, "show_progress": False, **config}
        return Ingestor(engine, store, LMDBDocumentRegistry(env), embedder, IngestJournal(env), IngestConfig(**config))

    yield make
    for resource in opened:
        resource.close()


@pytest.fixture
def ingestor(make_ingestor):
    return make_ingestor()


def _blob_count(ingestor) -> int:
    return len(list(ingestor.store.iter_keys()))


def test_chunks_cover_the_text_in_order(engine):
    chunks = chunk_document(engine.tokenizer, LIGHTHOUSE, 64)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(c.num_tokens == 64 for c in chunks[:-1]) and 0 < chunks[-1].num_tokens <= 64
    assert sum(c.num_tokens for c in chunks) == len(engine.tokenize(LIGHTHOUSE))
    assert chunks[0].char_start == 0 and chunks[-1].char_end == len(LIGHTHOUSE)
    rebuilt = "".join(LIGHTHOUSE[a.char_start : b.char_start] for a, b in zip(chunks, chunks[1:]))
    assert rebuilt + LIGHTHOUSE[chunks[-1].char_start :] == LIGHTHOUSE


def test_ingest_stores_every_chunk_and_registers_the_document(ingestor, engine):
    result = ingestor.ingest_text(LIGHTHOUSE, "lighthouse.txt", metadata={"source": "test"})
    record = ingestor.registry.get("default", result.doc_id)
    assert record.metadata == {"source": "test"} and len(record.chunks) == result.chunks
    for chunk in record.chunks:
        tensors = ingestor.store.get(ingestor.chunk_key("default", chunk.chunk_hash))
        assert tensors is not None
        assert tensors["tokens"].tolist() == engine.tokenize(LIGHTHOUSE)[chunk.token_start : chunk.token_end]
        keys, _ = engine.kv_format.unpack(tensors)
        assert tuple(keys.shape) == (30, 3, chunk.token_end - chunk.token_start, 64)


def test_reingesting_identical_text_reuses_everything(ingestor):
    first = ingestor.ingest_text(LIGHTHOUSE, "a.txt")
    blobs = _blob_count(ingestor)
    again = ingestor.ingest_text(LIGHTHOUSE, "b.txt")
    assert again.doc_id == first.doc_id and again.duplicate_of_existing and again.computed_chunks == 0
    assert _blob_count(ingestor) == blobs


def test_shared_chunks_are_computed_once_and_survive_deleting_one_user(ingestor):
    first = ingestor.ingest_text(LIGHTHOUSE, "a.txt")
    second = ingestor.ingest_text(LIGHTHOUSE + " And more about the orchard. " + ORCHARD, "b.txt")
    assert second.reused_chunks >= first.chunks - 1
    ingestor.delete(first.doc_id)
    record = ingestor.registry.get("default", second.doc_id)
    assert all(ingestor.store.contains(ingestor.chunk_key("default", c.chunk_hash)) for c in record.chunks)
    ingestor.delete(second.doc_id)
    assert _blob_count(ingestor) == 0
    with pytest.raises(NotFoundError):
        ingestor.registry.get("default", second.doc_id)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"   \n\t ", "empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00", "binary"),
        ("caf\u00e9".encode("latin-1"), "not_utf8"),
        (b"x" * 2048, "too_large"),
    ],
)
def test_bad_input_is_refused_with_a_reason(data, reason):
    with pytest.raises(InputError) as error:
        document_text(data, "upload.txt", max_bytes=1024)
    assert error.value.reason == reason
    assert "upload.txt" in str(error.value)


def test_unsupported_file_type_is_named():
    with pytest.raises(InputError, match="unsupported file type '.odt'"):
        document_text(b"PK\x03\x04", "paper.odt")


def test_html_markup_is_removed():
    text = document_text(
        b"<html><head><style>p{}</style></head><body><p>Hello <b>world</b></p></body></html>", "a.html"
    )
    assert text == "Hello world"


def test_bad_text_leaves_the_store_as_it_was(ingestor):
    ingestor.ingest_text(LIGHTHOUSE, "a.txt")
    before = (_blob_count(ingestor), len(ingestor.registry.list("default")))
    for text in ("", "\x00\x01\x02" * 100):
        with pytest.raises(InputError):
            ingestor.ingest_text(text, "bad.txt")
    assert (_blob_count(ingestor), len(ingestor.registry.list("default"))) == before


def test_failure_after_precompute_rolls_back_new_chunks(ingestor, monkeypatch):
    ingestor.ingest_text(LIGHTHOUSE, "a.txt")
    before = set(ingestor.store.iter_keys())

    def broken(texts):
        raise RuntimeError("embedder crashed")

    monkeypatch.setattr(ingestor.embedder, "embed_passages", broken)
    with pytest.raises(RuntimeError, match="embedder crashed"):
        ingestor.ingest_text(ORCHARD, "orchard.txt")
    assert set(ingestor.store.iter_keys()) == before
    assert [r.name for r in ingestor.registry.list("default")] == ["a.txt"]


def test_tenants_do_not_see_each_other(ingestor):
    result = ingestor.ingest_text(LIGHTHOUSE, "a.txt", tenant="alice")
    assert ingestor.registry.list("bob") == []
    with pytest.raises(NotFoundError):
        ingestor.registry.get("bob", result.doc_id)
    with pytest.raises(NotFoundError):
        ingestor.delete(result.doc_id, tenant="bob")
    with pytest.raises(InputError):
        ingestor.ingest_text(LIGHTHOUSE, "a.txt", tenant="../etc")


def test_a_store_that_cannot_take_the_write_fails_the_ingestion(make_ingestor):
    ingestor = make_ingestor(store=RedisStore(UNREACHABLE_REDIS))
    with pytest.raises(StoreUnavailableError, match="could not take the write"):
        ingestor.ingest_text(LIGHTHOUSE, "a.txt")
    assert ingestor.registry.list("default") == [] and ingestor.journal.entries() == []


def test_a_dead_cache_tier_is_skipped_when_the_durable_tier_took_the_write(make_ingestor, tmp_path):
    lmdb = LMDBStore(tmp_path / "db")
    ingestor = make_ingestor(store=TieredStore([lmdb, RedisStore(UNREACHABLE_REDIS)], lru_bytes=0))
    result = ingestor.ingest_text(LIGHTHOUSE, "a.txt")
    assert result.computed_chunks == result.chunks > 0
    record = ingestor.registry.get("default", result.doc_id)
    assert all(lmdb.contains(ingestor.chunk_key("default", chunk.chunk_hash)) for chunk in record.chunks)


def test_tenants_get_their_own_chunks_and_ids_by_default(ingestor):
    alice = ingestor.ingest_text(LIGHTHOUSE, "a.txt", tenant="alice")
    bob = ingestor.ingest_text(LIGHTHOUSE, "a.txt", tenant="bob")
    assert bob.reused_chunks == 0 and bob.computed_chunks == bob.chunks and not bob.duplicate_of_existing
    assert bob.doc_id != alice.doc_id
    hashes = {
        tenant: {c.chunk_hash for c in ingestor.registry.get(tenant, doc).chunks}
        for tenant, doc in (("alice", alice.doc_id), ("bob", bob.doc_id))
    }
    assert not hashes["alice"] & hashes["bob"]
    stored = {key.tenant for key in ingestor.store.iter_keys()}
    assert stored == {"alice", "bob"}  # each tenant's rows under a key that names it


def test_cross_tenant_sharing_when_the_deployment_opts_in(make_ingestor):
    ingestor = make_ingestor(share_chunks_across_tenants=True)
    alice = ingestor.ingest_text(LIGHTHOUSE, "a.txt", tenant="alice")
    bob = ingestor.ingest_text(LIGHTHOUSE, "a.txt", tenant="bob")
    assert bob.reused_chunks == bob.chunks and bob.computed_chunks == 0 and bob.doc_id == alice.doc_id
    ingestor.delete(alice.doc_id, tenant="alice")  # bob's document still holds the shared chunks
    assert all(
        ingestor.store.contains(ingestor.chunk_key("bob", c.chunk_hash))
        for c in ingestor.registry.get("bob", bob.doc_id).chunks
    )
    assert {key.tenant for key in ingestor.store.iter_keys()} == {""}  # shared rows name no tenant


def test_deleting_a_document_removes_every_models_blobs(ingestor):
    result = ingestor.ingest_text(ORCHARD, "orchard.txt")
    record = ingestor.registry.get("default", result.doc_id)
    tensors = ingestor.store.get(ingestor.chunk_key("default", record.chunks[0].chunk_hash))
    other_model = ChunkKey("another-model", record.chunks[0].chunk_hash, KV_FORMAT_VERSION)
    ingestor.store.put(other_model, tensors)  # what a recompute by another model leaves
    ingestor.delete(result.doc_id)
    assert _blob_count(ingestor) == 0


def test_gc_removes_unreferenced_blobs_only(ingestor):
    kept = ingestor.ingest_text(LIGHTHOUSE, "a.txt")
    tensors = ingestor.store.get(
        ingestor.chunk_key("default", ingestor.registry.get("default", kept.doc_id).chunks[0].chunk_hash)
    )
    for index in range(3):
        ingestor.store.put(ChunkKey(ingestor.engine.fingerprint, f"{index:032x}", KV_FORMAT_VERSION), tensors)
    live = ChunkKey(ingestor.engine.fingerprint, "f" * 32, KV_FORMAT_VERSION)
    ingestor.store.put(live, tensors)
    entry = ingestor.journal.begin([live])  # an ingestion of this process, still running
    dry = collect_garbage(ingestor.registry, ingestor.store, ingestor.journal, dry_run=True)
    assert (dry.unreferenced, dry.removed) == (3, 0) and dry.bytes >= 3 * sum(t.nbytes for t in tensors.values())
    assert _blob_count(ingestor) == kept.chunks + 4
    done = collect_garbage(ingestor.registry, ingestor.store, ingestor.journal)
    assert done.removed == 3 and done.bytes == dry.bytes and _blob_count(ingestor) == kept.chunks + 1
    ingestor.journal.end(entry)


def test_chunk_tokens_are_checked(make_ingestor):
    for bad in (0, -5, 8193):
        with pytest.raises(InputError, match="chunk_tokens must be in"):
            IngestConfig(chunk_tokens=bad)
    with pytest.raises(InputError, match="does not fit the model's context"):
        make_ingestor(chunk_tokens=8192)


def test_the_ingestion_benchmark_counts_what_it_ingested_and_reads_the_peers_timings(ingestor, tmp_path):
    """`ragkv bench ingest` over two small documents, beside a stand-in llama-server that
    answers /completion with llama.cpp's timings fields."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ragkv.bench.ingest_bench import IngestBenchConfig, documents, run_ingest_bench

    data = tmp_path / "dev.json"
    data.write_text(
        json.dumps(
            [
                {
                    "question": "q1",
                    "answers": ["a"],
                    "ctxs": [{"title": "", "text": LIGHTHOUSE}, {"title": "", "text": ORCHARD}],
                },
                {
                    "question": "q2",
                    "answers": ["b"],
                    "ctxs": [{"title": "", "text": ORCHARD}, {"title": "", "text": "Tides."}],
                },
            ]
        )
    )
    prompts = []

    class PeerStandIn(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompts.append(body)
            tokens = len(body["prompt"].split())
            reply = json.dumps(
                {"content": "x", "timings": {"prompt_n": tokens, "prompt_ms": tokens * 2.0, "prompt_per_second": 500.0}}
            )
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(reply.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), PeerStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = IngestBenchConfig(data, limit=2, passages=2, peer=f"http://127.0.0.1:{server.server_address[1]}")
        result = run_ingest_bench(ingestor, config, progress=lambda line: None)
    finally:
        server.shutdown()
    docs = documents(config)
    assert [text for _, text in docs] == [LIGHTHOUSE.strip() + "\n\n" + ORCHARD.strip(), ORCHARD.strip() + "\n\nTides."]
    assert [p["prompt"] for p in prompts] == [text for _, text in docs] and all(not p["cache_prompt"] for p in prompts)
    registered = ingestor.registry.list("default")
    assert result.documents == 2 and result.tokens == sum(record.num_tokens for record in registered)
    assert result.chunks == sum(len(record.chunks) for record in registered) and result.stored_tokens > 0
    assert result.encode_tokens_per_second > 0 and result.end_to_end_tokens_per_second > 0
    words = sum(len(text.split()) for _, text in docs)
    assert result.peer.prompt_tokens == words and result.peer.prompt_tokens_per_second == 500.0
    assert result.ratio_vs_peer == round(result.encode_tokens_per_second / 500.0, 3)
