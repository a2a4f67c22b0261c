"""The `ragkv` command end to end in subprocesses, on a fresh data folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"


def ragkv(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAGKV_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ragkv", *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("ragkv-home")
    result = ragkv(home, "ingest", str(CORPUS), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("doc_") == 3
    return home


@pytest.mark.model
def test_docs_list_shows_the_corpus(home):
    result = ragkv(home, "docs", "list")
    assert result.returncode == 0
    assert {"lighthouses.md", "orchard.txt", "observatory.md"} <= {
        Path(line.split()[-1]).name for line in result.stdout.splitlines()
    }


@pytest.mark.model
def test_ask_answers_with_citations_and_timings(home):
    result = ragkv(
        home, "ask", "When was Gull Point Light automated?", "--json", "--max-new-tokens", "24", "--top-k", "2"
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["strategy"] == "probe"
    assert answer["citations"][0]["name"].endswith("lighthouses.md")
    assert "automated in 1987" in answer["citations"][0]["text"]
    usage = answer["usage"]
    assert usage["cached_tokens"] > usage["recomputed_tokens"] > 0
    assert usage["cached_tokens"] + usage["computed_tokens"] == usage["prompt_tokens"]
    timings = answer["timings"]
    assert timings["ttft"] >= timings["retrieve"] + timings["load"] + timings["fuse"] > 0 and answer["answer"]
    assert answer["citations"][0]["document_id"].startswith("doc_")  # the API's field names


@pytest.mark.model
def test_docs_list_json_matches_the_api_fields(home):
    result = ragkv(home, "docs", "list", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert listed["object"] == "list" and len(listed["data"]) == 3
    assert {"id", "name", "tokens", "chunks", "created", "metadata"} <= set(listed["data"][0])
    shown = json.loads(ragkv(home, "docs", "show", listed["data"][0]["id"]).stdout)
    assert shown["id"] == listed["data"][0]["id"] and shown["chunks"][0]["index"] == 0


@pytest.mark.model
def test_docs_list_does_not_import_the_model(home):
    probe = (
        "import sys, runpy; sys.argv = ['ragkv', 'docs', 'list', '--json']\n"
        "try:\n    runpy.run_module('ragkv', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "assert 'ragkv.engine' not in sys.modules and 'transformers' not in sys.modules, 'model code imported'"
    )
    env = {**os.environ, "RAGKV_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.model
def test_reingest_reuses_and_delete_removes(home):
    again = ragkv(home, "ingest", str(CORPUS / "orchard.txt"), "--no-progress")
    assert "identical text already ingested" in again.stdout
    doc_id = again.stdout.split()[0]
    deleted = ragkv(home, "docs", "delete", doc_id)
    assert deleted.returncode == 0 and doc_id in deleted.stdout
    shown = ragkv(home, "docs", "show", doc_id)
    assert shown.returncode == 2 and "no document" in shown.stderr
    # the module's other tests, in any order, read the whole corpus
    restored = ragkv(home, "ingest", str(CORPUS / "orchard.txt"), "--no-progress")
    assert restored.returncode == 0, restored.stderr


def test_errors_are_messages_not_tracebacks(tmp_path):
    empty_home = tmp_path / "empty"
    asked = ragkv(empty_home, "ask", "anything?")
    assert asked.returncode == 2 and "ingest some documents first" in asked.stderr
    assert "Traceback" not in asked.stderr
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\x00\x01\x02\x03" * 64)
    ingested = ragkv(empty_home, "ingest", str(binary), "--no-progress")
    assert ingested.returncode == 1 and "binary" in ingested.stderr and "Traceback" not in ingested.stderr
    bad_ratio = ragkv(empty_home, "ask", "q?", "--ratio", "2")
    assert bad_ratio.returncode == 2 and "ratio" in bad_ratio.stderr


def test_unknown_flag_prints_the_subcommands_usage(tmp_path):
    result = ragkv(tmp_path, "docs", "list", "--bogus")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: ragkv docs") and "unrecognized arguments: --bogus" in result.stderr
    nested = ragkv(tmp_path, "bench", "store", "--bogus")
    assert nested.returncode == 2 and nested.stderr.startswith("usage: ragkv bench store")


def test_ask_help_groups_its_options(tmp_path):
    result = ragkv(tmp_path, "ask", "--help")
    assert result.returncode == 0
    sections = [
        line.rstrip(":") for line in result.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")
    ]
    assert {"retrieval", "fusion", "generation", "sparse decode", "engine/model", "store"} <= set(sections)
    sparse_section = result.stdout.split("sparse decode:")[1].split("engine/model:")[0]
    assert "--sparse-budget" in sparse_section and "--top-k" not in sparse_section


@pytest.mark.parametrize("command", [("docs", "list"), ("docs", "show", "doc_x"), ("ask", "q?")])
def test_read_only_commands_create_nothing(tmp_path, command):
    missing = tmp_path / "nonexistent" / "dir" / "db"
    home = tmp_path / "home"
    result = ragkv(home, *command, "--store", f"lmdb://{missing}")
    assert result.returncode == 2 and "nothing was created" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "nonexistent").exists() and not home.exists()


@pytest.mark.model
def test_an_unreachable_store_fails_the_ingestion(tmp_path):
    document = tmp_path / "note.txt"
    document.write_text("Gull Point Light was first lit in 1851 and automated in 1987. " * 20)
    result = ragkv(tmp_path / "home", "ingest", "--store", "redis://127.0.0.1:1/0", str(document), "--no-progress")
    assert result.returncode == 3, result.stderr
    assert "could not take the write" in result.stderr and "Traceback" not in result.stderr
    assert "computed" not in result.stdout
    listed = ragkv(tmp_path / "home", "docs", "list", "--json")
    assert json.loads(listed.stdout)["data"] == []


@pytest.mark.parametrize("value", ["0", "-5", "8193"])
def test_bad_chunk_tokens_are_refused(tmp_path, value):
    result = ragkv(tmp_path, "ingest", str(CORPUS), "--chunk-tokens", value)
    assert result.returncode == 2 and "chunk_tokens must be in [16, 8192]" in result.stderr


@pytest.mark.model
def test_chunk_tokens_past_the_model_context_are_refused(tmp_path):
    result = ragkv(tmp_path, "ingest", str(CORPUS), "--chunk-tokens", "8192", "--no-progress")
    assert result.returncode == 2 and "does not fit the model's context" in result.stderr


@pytest.mark.model
def test_folder_summary_lists_unsupported_files_and_tenants_are_isolated(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    text = (CORPUS / "orchard.txt").read_text()
    (folder / "orchard.txt").write_text(text)
    (folder / "scan.odt").write_bytes(b"PK\x03\x04")
    (folder / "photo.jpg").write_bytes(b"\xff\xd8\xff")
    home = tmp_path / "home"
    alice = ragkv(home, "ingest", str(folder), "--json", "--no-progress", "--tenant", "alice", "--chunk-tokens", "64")
    assert alice.returncode == 0, alice.stderr
    summary = json.loads(alice.stdout)
    assert sorted(Path(p).name for p in summary["unsupported"]) == ["photo.jpg", "scan.odt"]
    assert "scan.odt: unsupported file type" in alice.stderr
    totals = summary["totals"]
    assert (totals["files"], totals["ingested"], totals["failed"], totals["unsupported"]) == (1, 1, 0, 2)
    assert totals["computed_chunks"] == totals["chunks"] > 1 and totals["stored_bytes"] > 0
    document = summary["documents"][0]

    def ingest_as(tenant: str, *extra: str) -> dict:
        result = ragkv(
            home,
            "ingest",
            str(folder / "orchard.txt"),
            "--json",
            "--no-progress",
            "--tenant",
            tenant,
            "--chunk-tokens",
            "64",
            *extra,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["documents"][0]

    bob = ingest_as("bob")
    assert bob["reused_chunks"] == 0 and bob["id"] != document["id"]
    carol = ingest_as("carol", "--share-chunks-across-tenants")
    dave = ingest_as("dave", "--share-chunks-across-tenants")
    assert carol["computed_chunks"] == carol["chunks"]
    assert dave["reused_chunks"] == dave["chunks"] and dave["id"] == carol["id"]


def _stored_blobs(db: Path) -> int:
    from ragkv.store.lmdb_store import LMDBStore

    with LMDBStore(db, create=False) as store:
        return sum(1 for _ in store.iter_keys())


@pytest.mark.model
def test_killed_ingestion_leaves_no_unreferenced_blob_after_the_next_start(tmp_path):
    home = tmp_path / "home"
    big = tmp_path / "big.txt"
    big.write_text(
        " ".join(f"Entry {n}: the keeper logged {n * 7 % 101} ships and {n % 13} storms." for n in range(2500))
    )
    env = {**os.environ, "RAGKV_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "ragkv", "ingest", str(big), "--chunk-tokens", "32", "--no-progress"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    db = home / "db"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if (db / "data.mdb").is_file() and _stored_blobs(db) >= 5:
            break
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read().decode()
    process.kill()  # SIGKILL: no clean-up code runs
    process.wait()
    orphans = _stored_blobs(db)
    assert orphans >= 5
    assert json.loads(ragkv(home, "docs", "list", "--json").stdout)["data"] == []  # nothing references them
    assert _stored_blobs(db) == orphans  # a read-only command settles nothing

    small = tmp_path / "small.txt"
    small.write_text("Linden Hill Orchard grows nineteen apple varieties on M9 rootstock. " * 6)
    restarted = ragkv(home, "ingest", str(small), "--chunk-tokens", "32", "--json", "--no-progress")
    assert restarted.returncode == 0, restarted.stderr
    assert "settled 1 interrupted ingestion" in restarted.stderr
    kept = json.loads(restarted.stdout)["totals"]["computed_chunks"]
    assert _stored_blobs(db) == kept
    gc = ragkv(home, "store", "gc", "--dry-run", "--json")
    assert gc.returncode == 0 and json.loads(gc.stdout)["unreferenced"] == 0
