"""GGUF files served end to end by a real `ragkv serve --model <file>` (uvicorn, LMDB store):
ingest, `/v1/query` with citations, and a two-turn chat whose follow-up reuses the first
turn's KV; for a tiny random Qwen2 GGUF written by the test and for the packaged Gemma 3
270M (where its package is installed: `scripts/install.sh --dev`). A GGUF of an unsupported
architecture is refused before the server starts (exit code 2, the architecture named)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gemma_gguf
import httpx
import pytest
from tiny_gguf import write_tiny_gguf

from ragkv.api.launcher import ServerProcess

pytestmark = pytest.mark.model

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"


def _model_file(name: str, root: Path) -> Path:
    if name == "tiny-qwen2.Q4_1":
        return write_tiny_gguf("qwen2", root / f"{name}.gguf", "Q4_1", context_length=8192)
    if not gemma_gguf.installed():
        pytest.skip("the Gemma 3 270M package is not installed (scripts/install.sh --dev installs it)")
    return gemma_gguf.gguf_path()


@pytest.fixture(scope="module", params=["tiny-qwen2.Q4_1", "gemma-3-270m-q4_k_m"])
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-serve")
    model = _model_file(request.param, root)
    args = ["--model", str(model), "--data-dir", str(root / "data"), "--log-level", "warning"]
    env = {} if request.param.startswith("gemma") else {"RAGKV_CACHE": str(root / "cache")}  # Gemma: its cache
    process = ServerProcess(args, env=env, log_path=root / "serve.log")
    process.start(timeout_s=600)
    process.model_name = request.param
    yield process
    process.stop()


def test_a_gguf_serves_ingest_query_and_a_reusing_chat(server):
    with httpx.Client(base_url=server.url, timeout=300) as http:
        served = [model["id"] for model in http.get("/v1/models").json()["data"]]
        assert server.model_name in served  # named after the file
        ids = {}
        for path in sorted(CORPUS.iterdir()):
            response = http.post("/v1/documents", json={"text": path.read_text(), "name": path.name})
            assert response.status_code == 201, response.text
            ids[path.name] = response.json()["document"]["id"]

        response = http.post(
            "/v1/query", json={"question": "When was Gull Point Light first lit?", "top_k": 2, "max_tokens": 6}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["citations"][0]["document_id"] == ids["lighthouses.md"]
        assert "Gull Point" in body["citations"][0]["text"]
        assert body["usage"]["cached_tokens"] > 0 and 1 <= body["usage"]["completion_tokens"] <= 6

        question = [{"role": "user", "content": "How tall is Stormhead Light?"}]
        first = http.post(
            "/v1/chat/completions", json={"model": "ragkv", "max_tokens": 6, "messages": question, "rag": {"top_k": 2}}
        )
        assert first.status_code == 200, first.text
        first = first.json()
        history = question + [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Who built it?"},
        ]
        second = http.post(
            "/v1/chat/completions",
            json={
                "model": "ragkv",
                "max_tokens": 6,
                "messages": history,
                "session_id": first["session_id"],
                "rag": {"top_k": 2},
            },
        )
        assert second.status_code == 200, second.text
        second = second.json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert second["rag"]["turn"] == 2 and cached >= first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens"] - cached - second["usage"]["document_tokens"] < 60  # + newly fused chunks


def test_serve_refuses_an_unsupported_architecture_before_starting(tmp_path):
    model = write_tiny_gguf("llama", tmp_path / "phi.gguf", "F16", architecture="phi3")
    command = [
        sys.executable,
        "-m",
        "ragkv",
        "serve",
        "--model",
        str(model),
        "--data-dir",
        str(tmp_path / "data"),
        "--port",
        "9",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "RAGKV_CACHE": str(tmp_path / "cache")}
    )
    assert done.returncode == 2, done.stderr
    assert "'phi3'" in done.stderr and "qwen2" in done.stderr and "Traceback" not in done.stderr
