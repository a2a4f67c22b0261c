"""Each numerics option through the user path on a tiny model: ingest, every fusion
strategy, generation."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from ragkv.cli.main import main
from ragkv.fusion import STRATEGY_NAMES

pytestmark = pytest.mark.model  # the packaged SmolLM2 tokenizer or model

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
OPTIONS = {
    "auto": [],
    "int8-float32-cache": ["--weights", "int8", "--prefill-weights", "float32", "--kv-cache-dtype", "float32"],
    "bfloat16-prefill": ["--weights", "float32", "--prefill-weights", "bfloat16", "--kv-cache-dtype", "float32"],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("RAGKV_CACHE", str(tmp_path_factory.mktemp("ragkv-cache")))
    yield make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama-numerics"), tokenizer=True)
    patch.undo()


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_option_ingests_fuses_and_answers(option, folder, tmp_path, capsys):
    common = ["--data-dir", str(tmp_path), "--model", str(folder), *OPTIONS[option]]
    assert main(["ingest", str(CORPUS), "--no-progress", *common]) == 0
    for strategy in STRATEGY_NAMES:
        code = main(["ask", "When was the light automated?", "--strategy", strategy, "--max-new-tokens", "3", *common])
        assert code == 0, f"{option}/{strategy}: {capsys.readouterr().err}"
