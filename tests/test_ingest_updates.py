"""Document updates, the store a registry meets, and PDF/DOCX round trips, with the
packaged model and embedder on real LMDB files: a replace swaps versions atomically
(also under SIGKILL at points inside it), identical text fills a store that lacks its KV,
and citations of a PDF name the page."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from document_files import PAGE_FACTS, docx_bytes, pdf_bytes

from ragkv.app.rag import RagPipeline
from ragkv.app.storage import Storage, StorageConfig
from ragkv.errors import InputError
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.errors import NotFoundError
from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.loaders import load_document
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import LMDBStore

ROOT = Path(__file__).resolve().parent.parent

SECTIONS = [
    f"Section {i}: the {animal} of ward {i} was counted at {i * 37} in the spring survey. " * 3
    for i, animal in enumerate(["heron", "otter", "badger", "kestrel", "newt", "hare"])
]
VERSION_1 = "".join(SECTIONS)
VERSION_2 = "".join(SECTIONS[:-1]) + "Section 5: the hares moved north; none were counted in the spring survey. " * 3


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture
def make_ingestor(engine, embedder, tmp_path):
    """Ingestor over the registry in tmp_path/db and the given store (default: the same env)."""
    opened = []

    def make(store=None):
        env = LMDBEnvironment(tmp_path / "db")
        store = store or LMDBStore(tmp_path / "db")
        opened.extend((store, env))
        config = IngestConfig(chunk_tokens=32, show_progress=False)
        return Ingestor(engine, store, LMDBDocumentRegistry(env), embedder, IngestJournal(env), config)

    yield make
    for resource in opened:
        resource.close()


def stored_keys(ingestor) -> set:
    return {key.to_bytes() for key in ingestor.store.iter_keys()}


def searched(ingestor, text: str, doc_id: str, k: int = 50) -> set[str]:
    """Texts of the chunks of `doc_id` that retrieval can return."""
    record = ingestor.registry.get("default", doc_id)
    full = ingestor.registry.text("default", doc_id)
    hits = ingestor.registry.search("default", ingestor.embedder.embed_queries([text])[0], k)
    return {
        full[record.chunks[h.chunk_index].char_start : record.chunks[h.chunk_index].char_end]
        for h in hits
        if h.doc_id == doc_id
    }


def test_replace_keeps_the_id_reuses_unchanged_chunks_and_retires_the_old_ones(make_ingestor):
    ingestor = make_ingestor()
    first = ingestor.ingest_text(VERSION_1, "survey.txt", metadata={"team": "ecology"})
    old = ingestor.registry.get("default", first.doc_id)
    keys_before = stored_keys(ingestor)
    second = ingestor.ingest_text(VERSION_2, "survey.txt", replaces=first.doc_id)
    new = ingestor.registry.get("default", first.doc_id)
    assert second.doc_id == first.doc_id and second.replaced and new.metadata == {"team": "ecology"}
    shared = {c.chunk_hash for c in old.chunks} & {c.chunk_hash for c in new.chunks}
    assert len(shared) >= len(old.chunks) // 2  # the unchanged first sections
    assert second.reused_chunks == len(shared) and second.computed_chunks == len(new.chunks) - len(shared)
    assert len(ingestor.registry.list("default")) == 1 and ingestor.registry.text("default", first.doc_id) == VERSION_2
    # the old version's own chunks left the store and retrieval; the new ones are in both
    retired = {ingestor.chunk_key("default", c.chunk_hash).to_bytes() for c in old.chunks if c.chunk_hash not in shared}
    assert retired and not retired & stored_keys(ingestor)
    assert {ingestor.chunk_key("default", c.chunk_hash).to_bytes() for c in new.chunks} <= stored_keys(ingestor)
    assert keys_before - retired <= stored_keys(ingestor)
    found = searched(ingestor, "hare", first.doc_id)
    assert found and all("hares moved north" in text or "Section 5" not in text for text in found)
    for chunk in new.chunks:
        assert ingestor.registry.refcount(chunk.chunk_hash) == 1


def test_replace_refusals_change_nothing(make_ingestor):
    ingestor = make_ingestor()
    first = ingestor.ingest_text(VERSION_1, "a.txt")
    other = ingestor.ingest_text(SECTIONS[0] * 4, "b.txt")
    keys = stored_keys(ingestor)
    with pytest.raises(InputError, match=f"document {other.doc_id} already holds this exact text"):
        ingestor.ingest_text(SECTIONS[0] * 4, "a.txt", replaces=first.doc_id)
    with pytest.raises(NotFoundError):
        ingestor.ingest_text(VERSION_2, "c.txt", replaces="doc_missing")
    same = ingestor.ingest_text(VERSION_1, "a.txt", replaces=first.doc_id)
    assert same.duplicate_of_existing and same.computed_chunks == 0
    assert stored_keys(ingestor) == keys and ingestor.registry.text("default", first.doc_id) == VERSION_1


def test_a_new_version_with_the_same_text_changes_only_the_record(make_ingestor):
    """PUT with the text unchanged (the web page's metadata editing): the metadata and name
    change, no chunk is computed and the store is untouched; a PDF's pages are kept."""
    ingestor = make_ingestor()
    first = ingestor.ingest_text(VERSION_1, "a.txt", pages=[[0, 40], [41, len(VERSION_1)]])
    keys = stored_keys(ingestor)
    edited = ingestor.ingest_text(
        VERSION_1, "a.txt", replaces=first.doc_id, metadata={"team": "x"}, pages=[[0, 40], [41, len(VERSION_1)]]
    )
    assert edited.doc_id == first.doc_id and edited.replaced and edited.computed_chunks == 0
    record = ingestor.registry.get("default", first.doc_id)
    assert record.metadata == {"team": "x"} and record.pages == [[0, 40], [41, len(VERSION_1)]]
    assert stored_keys(ingestor) == keys and len(ingestor.registry.list("default")) == 1
    renamed = ingestor.ingest_text(VERSION_1, "b.txt", replaces=first.doc_id, pages=record.pages)
    assert renamed.doc_id == first.doc_id and ingestor.registry.get("default", first.doc_id).name == "b.txt"
    assert ingestor.registry.find_by_text("default", record.text_hash) == first.doc_id


_KILLED_UPDATE = """
import os, signal, sys, time
from ragkv.engine import Engine, EngineConfig
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import LMDBStore

db, point, version_1, version_2 = sys.argv[1:]
env = LMDBEnvironment(db)
registry = LMDBDocumentRegistry(env)
engine = Engine(EngineConfig(weights="float32", prefill_weights="float32", kv_cache_dtype="float32"))
ingestor = Ingestor(engine, LMDBStore(db), registry, Embedder(), IngestJournal(env),
                    IngestConfig(chunk_tokens=32, show_progress=False))
doc_id = ingestor.ingest_text(open(version_1).read(), "survey.txt").doc_id
print("v1", doc_id, flush=True)

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def mid_precompute(done, total):
    if done == 1:  # a new chunk is stored, the registry not yet touched: the parent kills us
        print("mid", flush=True)
        time.sleep(600)

class DyingEnv:
    # the registry's environment, dying inside its next write transaction

    def __getattr__(self, name):
        return getattr(env, name)

    def write(self, fn):
        return env.write(lambda txn: (fn(txn), die()))

if point == "in_transaction":  # every write of the replace done, the transaction not committed
    registry.env = DyingEnv()
elif point == "after_commit":  # committed; the old version's blobs not yet deleted
    ingestor.store.delete = lambda key: die()
ingestor.ingest_text(open(version_2).read(), "survey.txt", replaces=doc_id,
                     progress=mid_precompute if point == "precompute" else None)
print("finished", flush=True)
"""


@pytest.mark.parametrize("point", ["precompute", "in_transaction", "after_commit"])
def test_a_kill_inside_an_update_leaves_one_version_whole(tmp_path, engine, embedder, point):
    (tmp_path / "v1.txt").write_text(VERSION_1)
    (tmp_path / "v2.txt").write_text(VERSION_2)
    db = tmp_path / "data" / "db"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_KILLED_UPDATE),
            str(db),
            point,
            str(tmp_path / "v1.txt"),
            str(tmp_path / "v2.txt"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        doc_id = child.stdout.readline().split()[1]
        if point == "precompute":
            assert child.stdout.readline().strip() == "mid"
            child.send_signal(signal.SIGKILL)
        child.wait(timeout=600)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL, child.stderr.read()

    expected = VERSION_2 if point == "after_commit" else VERSION_1
    # Opening the data folder for writing settles what the dead process left (its journal).
    with Storage(StorageConfig(data_dir=tmp_path / "data")) as storage:
        registry, store = storage.registry, storage.store
        record = registry.get("default", doc_id)
        assert registry.text("default", doc_id) == expected and [r.doc_id for r in registry.list("default")] == [doc_id]
        assert record.num_tokens == len(engine.tokenize(expected))
        rag = RagPipeline(engine, store, registry, embedder)
        keys = {rag.chunk_key("default", c.chunk_hash).to_bytes() for c in record.chunks}
        assert {key.to_bytes() for key in store.iter_keys()} == keys  # all of this version, nothing else
        for chunk in record.chunks:
            assert registry.refcount(chunk.chunk_hash) == 1
        retrieved = [(record, chunk, 1.0) for chunk in record.chunks]
        _, recomputed = rag.load_chunks("default", retrieved)
        assert recomputed == []
        hits = registry.search("default", embedder.embed_queries(["hare"])[0], 100)
        assert sorted(h.chunk_index for h in hits) == list(range(len(record.chunks)))
        assert not storage.journal.entries()


def test_identical_text_fills_a_new_store_and_the_next_question_misses_nothing(make_ingestor, tmp_path, caplog):
    first = make_ingestor().ingest_text(VERSION_1, "survey.txt")
    assert first.computed_chunks == first.chunks
    other = LMDBStore(tmp_path / "elsewhere")
    ingestor = make_ingestor(store=other)
    with caplog.at_level("WARNING", logger="ragkv.ingest"):
        again = ingestor.ingest_text(VERSION_1, "survey.txt")
    assert again.duplicate_of_existing and again.doc_id == first.doc_id
    assert again.computed_chunks == again.chunks and again.stored_bytes > 0
    assert "missing from this store" in caplog.text
    record = ingestor.registry.get("default", first.doc_id)
    rag = RagPipeline(ingestor.engine, other, ingestor.registry, ingestor.embedder)
    retrieved = rag.retrieve("how many otters were counted?", "default", 4, None)
    assert retrieved and rag.load_chunks("default", retrieved)[1] == []  # no miss, nothing recomputed
    assert {k.to_bytes() for k in other.iter_keys()} == {
        rag.chunk_key("default", c.chunk_hash).to_bytes() for c in record.chunks
    }
    third = ingestor.ingest_text(VERSION_1, "survey.txt")
    assert third.computed_chunks == 0 and third.reused_chunks == third.chunks


def test_a_registry_meeting_another_store_says_so(tmp_path, caplog):
    data = tmp_path / "data"
    with Storage(StorageConfig(data_dir=data)) as storage:
        assert storage.previous_store is None
    elsewhere = f"lmdb://{tmp_path / 'elsewhere'}"
    with caplog.at_level("WARNING", logger="ragkv.ingest"):
        with Storage(StorageConfig(data_dir=data, store_url=elsewhere)) as storage:
            assert storage.previous_store == f"lmdb://{(data / 'db').resolve()}"
    assert "last used with the chunk store" in caplog.text and elsewhere in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ragkv.ingest"):
        with Storage(StorageConfig(data_dir=data, store_url=elsewhere)) as storage:
            assert storage.previous_store is None
    assert "last used" not in caplog.text


def _ragkv(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAGKV_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "ragkv", *args], capture_output=True, text=True, env=env, timeout=900)


def test_pdf_and_docx_round_trip_with_page_numbered_citations(tmp_path):
    """`ragkv ingest report.pdf notes.docx`, then `ragkv ask --json`: the citation of a
    fact on page 3 of the PDF says page 3; the DOCX's citations carry no page."""
    folder = tmp_path / "files"
    folder.mkdir()
    filler = "The annual report continues with routine figures about staffing and budgets. " * 5
    (folder / "report.pdf").write_bytes(
        pdf_bytes([filler + PAGE_FACTS[0], filler + PAGE_FACTS[1], filler + PAGE_FACTS[2]])
    )
    (folder / "notes.docx").write_bytes(docx_bytes(["Meeting notes. The library roof repair was approved in May."]))
    home = tmp_path / "home"
    ingested = _ragkv(
        home,
        "ingest",
        str(folder / "report.pdf"),
        str(folder / "notes.docx"),
        "--json",
        "--no-progress",
        "--chunk-tokens",
        "48",
    )
    assert ingested.returncode == 0, ingested.stderr
    totals = json.loads(ingested.stdout)["totals"]
    assert totals["ingested"] == 2 and totals["encode_tokens_per_second"] > 0
    asked = _ragkv(
        home, "ask", "When does the ferry to Inish More leave?", "--json", "--top-k", "2", "--max-new-tokens", "4"
    )
    assert asked.returncode == 0, asked.stderr
    citations = json.loads(asked.stdout)["citations"]
    best = max(citations, key=lambda c: c["score"])
    assert best["name"].endswith("report.pdf") and best["page"] == 3
    assert "07:45" in best["text"] or "Inish" in best["text"]
    loaded = load_document((folder / "report.pdf").read_bytes(), "report.pdf")
    for citation in citations:
        if citation["name"].endswith("report.pdf"):
            start, end = loaded.pages[citation["page"] - 1]
            assert start <= citation["char_start"] + len(citation["text"]) - len(citation["text"].lstrip()) < end
        else:
            assert citation["page"] is None
    # the same name again, edited: replaced in place (same id), not added
    (folder / "notes.docx").write_bytes(docx_bytes(["Meeting notes. The library roof repair was postponed to June."]))
    again = _ragkv(home, "ingest", str(folder / "notes.docx"), "--json", "--no-progress", "--chunk-tokens", "48")
    document = json.loads(again.stdout)["documents"][0]
    assert document["replaced"] and len(json.loads(_ragkv(home, "docs", "list", "--json").stdout)["data"]) == 2


def test_batched_chunk_encoding_matches_one_by_one(engine):
    """Chunks of different lengths encoded in one pass get the KV that encoding each alone
    gives (float32 reference numerics), and the stored form built from it."""
    ids = engine.tokenize(VERSION_1 + VERSION_2)
    chunks = [ids[:48], ids[48:80], ids[80:81], ids[81:160]]
    prefix = engine.chunk_prefix_cache()
    together = engine.model.chunk_kv_many([torch.tensor(c) for c in chunks], prefix)
    for token_ids, (keys, values) in zip(chunks, together):
        keys_alone, values_alone = engine.model.chunk_kv(torch.tensor(token_ids), prefix)
        torch.testing.assert_close(keys, keys_alone, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(values, values_alone, atol=1e-4, rtol=1e-4)
    for token_ids, stored in zip(chunks, engine.encode_chunks(chunks)):
        alone = engine.encode_chunk(token_ids)
        assert stored.keys() == alone.keys() and stored["tokens"].tolist() == token_ids
        for name, single in alone.items():
            assert stored[name].shape == single.shape and stored[name].dtype == single.dtype, name
        # int4 codes of values within 1e-4 of each other may fall either side of a rounding
        # edge: the dequantised keys agree to well under one quantisation step on average
        keys_b = engine.kv_format.dense_keys(stored, torch.float32)
        keys_a = engine.kv_format.dense_keys(alone, torch.float32)
        assert (keys_b - keys_a).abs().mean() < 0.01 * keys_a.abs().mean()


def test_ingestion_batches_chunks_by_tokens(make_ingestor):
    ingestor = make_ingestor()
    calls = []
    encode_chunks = ingestor.engine.encode_chunks
    ingestor.engine.encode_chunks = lambda chunks, codebook=None: (
        calls.append([len(c) for c in chunks]) or encode_chunks(chunks, codebook)
    )
    try:
        ingestor.config = IngestConfig(chunk_tokens=32, show_progress=False, encode_batch_tokens=160)
        result = ingestor.ingest_text(VERSION_1, "survey.txt")
    finally:
        del ingestor.engine.encode_chunks
    n = result.computed_chunks
    assert sum(map(len, calls)) == n - (n % 5 == 1) and all(sum(sizes) <= 160 for sizes in calls)
    assert max(map(len, calls)) == 5 and result.encode_tokens_per_second > 0
    record = ingestor.registry.get("default", result.doc_id)
    for chunk in record.chunks:
        assert (
            ingestor.store.get(ingestor.chunk_key("default", chunk.chunk_hash))["tokens"].numel()
            == chunk.token_end - chunk.token_start
        )
