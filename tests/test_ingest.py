"""Ingestion end to end on a real LMDB environment with the packaged model and embedder:
chunking, reuse, deletion, bad input, and roll-back on failure."""

from __future__ import annotations

import pytest

from ragkv.ingest.chunker import chunk_document
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.errors import InputError, NotFoundError
from ragkv.ingest.loaders import document_text
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.ingest.registry_lmdb import LMDBRegistry
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import LMDBStore

LIGHTHOUSE = "Gull Point Light was first lit in 1851 and automated in 1987. " * 12
ORCHARD = "Linden Hill Orchard grows nineteen apple varieties on M9 rootstock. " * 12


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture
def ingestor(engine, embedder, tmp_path):
    env = LMDBEnvironment(tmp_path / "db")
    store = LMDBStore(tmp_path / "db")
    yield Ingestor(engine, store, LMDBRegistry(env), embedder, IngestConfig(chunk_tokens=64, show_progress=False))
    store.close()
    env.close()


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
        tensors = ingestor.store.get(ingestor.chunk_key(chunk.chunk_hash))
        assert tensors is not None
        assert tensors["tokens"].tolist() == engine.tokenize(LIGHTHOUSE)[chunk.token_start : chunk.token_end]
        assert tensors["keys"].shape == (30, 3, chunk.token_end - chunk.token_start, 64)


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
    assert all(ingestor.store.contains(ingestor.chunk_key(c.chunk_hash)) for c in record.chunks)
    ingestor.delete(second.doc_id)
    assert _blob_count(ingestor) == 0
    with pytest.raises(NotFoundError):
        ingestor.registry.get("default", second.doc_id)


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "empty"), (b"   \n\t ", "empty"), (b"\x89PNG\r\n\x1a\n\x00\x00\x00", "binary"),
    ("caf\u00e9".encode("latin-1"), "not_utf8"), (b"x" * 2048, "too_large"),
])
def test_bad_input_is_refused_with_a_reason(data, reason):
    with pytest.raises(InputError) as error:
        document_text(data, "upload.txt", max_bytes=1024)
    assert error.value.reason == reason
    assert "upload.txt" in str(error.value)


def test_unsupported_file_type_is_named():
    with pytest.raises(InputError, match="unsupported file type '.pdf'"):
        document_text(b"%PDF-1.4", "paper.pdf")


def test_html_markup_is_removed():
    text = document_text(b"<html><head><style>p{}</style></head><body><p>Hello <b>world</b></p></body></html>", "a.html")
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
