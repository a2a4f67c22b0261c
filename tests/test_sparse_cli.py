"""`ragkv calibrate` and `ragkv bench sparse` end to end (in process) on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from ragkv.app.codebooks import load_codebook
from ragkv.app.runtime import Runtime, RuntimeConfig
from ragkv.cli.main import build_parser, main
from ragkv.engine import EngineConfig

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama-cli"), tokenizer=True)
    home = tmp_path_factory.mktemp("ragkv-home")
    patch = pytest.MonkeyPatch()
    patch.setenv("RAGKV_CACHE", str(tmp_path_factory.mktemp("ragkv-cache")))
    yield folder, home
    patch.undo()


def test_parser_knows_the_sparse_commands():
    parser = build_parser()
    args = parser.parse_args(["calibrate", "a.txt", "--codebook-size", "64", "--tokens", "2048", "--from-store"])
    assert args.command == "calibrate" and args.codebook_size == 64 and args.from_store
    args = parser.parse_args(
        [
            "bench",
            "sparse",
            "--data",
            "x.json",
            "--budget",
            "0.06",
            "--selectors",
            "a2ats",
            "lrqk",
            "--context-lengths",
            "2048",
            "4096",
        ]
    )
    assert args.bench == "sparse" and args.selectors == ["a2ats", "lrqk"] and args.context_lengths == [2048, 4096]


@pytest.mark.model
def test_calibrate_stores_the_codebook_and_backfills_codes(setup, capsys):
    folder, home = setup
    common = ["--data-dir", str(home), "--model", str(folder)]
    assert main(["ingest", str(CORPUS), "--no-progress", *common]) == 0
    code = main(
        [
            "calibrate",
            "--from-store",
            "--codebook-size",
            "16",
            "--tokens",
            "256",
            "--sequence-tokens",
            "128",
            "--iterations",
            "2",
            *common,
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "codebook" in out and "codes added to" in out
    backfilled = int(out.split("codes added to ")[1].split()[0])
    with Runtime(RuntimeConfig(data_dir=home, engine=EngineConfig(model=str(folder)))) as runtime:
        codebook = load_codebook(runtime.env, runtime.engine.fingerprint)
        assert codebook is not None and codebook.size == 16
        records = runtime.registry.list("default")
        hashes = {chunk.chunk_hash for record in records for chunk in record.chunks}
        assert backfilled == len(hashes) > 0
        for chunk_hash in hashes:
            tensors = runtime.store.get(runtime.rag.chunk_key("default", chunk_hash))
            keys = runtime.engine.kv_format.dense_keys(tensors, torch.float32)
            assert torch.equal(codebook.codes_of(tensors), codebook.encode(keys))


@pytest.mark.model
def test_bench_sparse_writes_figures(setup, tmp_path, capsys):
    folder, home = setup
    data = tmp_path / "qa.json"
    passages = [
        {"title": f"P{i}", "text": CORPUS.joinpath(name).read_text()[:600]}
        for i, name in enumerate(sorted(p.name for p in CORPUS.iterdir()))
    ]
    data.write_text(
        json.dumps([{"ctxs": passages, "question": "When was the light automated?", "answers": ["1987"]}] * 2)
    )
    out_json = tmp_path / "sparse.json"
    code = main(
        [
            "bench",
            "sparse",
            "--data",
            str(data),
            "--limit",
            "1",
            "--budget",
            "0.3",
            "--selectors",
            "dense",
            "oracle",
            "a2ats",
            "--context-lengths",
            "256",
            "--timing-steps",
            "2",
            "--max-new-tokens",
            "4",
            "--json",
            str(out_json),
            "--data-dir",
            str(home),
            "--model",
            str(folder),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "a2ats" in table and "ms@256" in table
    results = json.loads(out_json.read_text())
    quality = results["quality"]["selectors"]
    assert quality["dense"]["f1_dense"] == 1.0
    assert quality["oracle"]["recall"] == pytest.approx(1.0, abs=1e-5)
    assert 0.0 < quality["a2ats"]["recall"] <= 1.0 + 1e-6
    speed = results["speed"]["context_lengths"]["256"]
    assert set(speed) == {"engine_dense", "dense", "oracle", "a2ats"}
    assert all(row["ms_per_token"] > 0 for row in speed.values())
    memory = results["memory"]["selectors"]["a2ats"]
    assert memory["aux_bytes_per_token"] == 2 * 2 * 2  # int16 code x 2 layers x 2 KV heads
