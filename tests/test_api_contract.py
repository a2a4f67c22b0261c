"""The API contract end to end: inputs that used to answer 500 answer 4xx with a message, a
500 leaves the keep-alive connection usable, /v1/query checks the context length, usage
counts recomputed chunks as computed, validation errors are 400.

A real `ragkv serve` (uvicorn) on a free port with an API key and an LMDB store; the tests
of this module share it and run in file order.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request

from ragkv.api.auth import Authenticator
from ragkv.api.errors import install_error_handlers
from ragkv.api.launcher import ServerProcess, free_port
from ragkv.api.metrics import Metrics
from ragkv.api.middleware import ServingMiddleware
from ragkv.api.responses import SafeJSONResponse
from ragkv.ingest.registry import ChunkRecord, DocumentRecord
from ragkv.ingest.registry_lmdb import LMDBRegistry
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import CHUNKS_DB

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
KEY, ODD_KEY = "contract-key-0001", "oddity-key-00002"
MODEL_CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings


def _seed_odd_document(db_path: Path) -> None:
    """A document whose stored metadata holds a lone surrogate, as an older server let in."""
    env = LMDBEnvironment(db_path)
    try:
        record = DocumentRecord("doc_odd", "oddity", "odd.txt", "hash_odd", 3, 512, "fp", time.time(),
                                [ChunkRecord(0, "chunk_odd", 0, 3, 0, 11)], {"k": "\udfff"})
        LMDBRegistry(env).add(record, "odd content", np.zeros((1, 384), dtype=np.float32))
    finally:
        env.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    keys = root / "keys.json"
    keys.write_text(json.dumps({KEY: "contract", ODD_KEY: "oddity"}))
    _seed_odd_document(root / "data" / "db")
    args = ["--data-dir", str(root / "data"), "--api-keys", str(keys), "--max-new-tokens", "8192", "--log-level", "warning"]
    with ServerProcess(args, log_path=root / "serve.log") as process:
        with httpx.Client(base_url=process.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as http:
            for path in sorted(CORPUS.iterdir()):
                response = http.post("/v1/documents", json={"text": path.read_text(), "name": path.name})
                assert response.status_code == 201, response.text
        yield {"process": process, "root": root}


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server["process"].url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as client:
        yield client


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["message"] and body["request_id"] and "Traceback" not in response.text
    return body["error"]


QUESTION = {"question": "When was Gull Point Light first lit?", "top_k": 1, "max_tokens": 4}
CHAT = {"model": "ragkv", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


# -- what used to be a 500 ----------------------------------------------------------------------

def test_snapkv_capacity_below_the_rows_it_must_keep_is_400(http):
    error = _error(http.post("/v1/query", json={**QUESTION, "snapkv_capacity": 1}), 400)
    assert error["code"] == "snapkv_capacity_too_small" and "prefix and question rows" in error["message"]
    assert http.post("/v1/query", json={**QUESTION, "snapkv_capacity": 4096}).status_code == 200


def test_seed_outside_64_bits_is_400_and_greedy_decoding_ignores_the_seed(http):
    assert "seed" in _error(http.post("/v1/query", json={**QUESTION, "seed": 2**64}), 400)["message"]
    assert "seed" in _error(http.post("/v1/chat/completions", json={**CHAT, "seed": -(2**63) - 1}), 400)["message"]
    greedy = [http.post("/v1/query", json={**QUESTION, "seed": seed}).json()["answer"] for seed in (None, 2**64 - 1)]
    assert greedy[0] == greedy[1]
    sampled = http.post("/v1/query", json={**QUESTION, "seed": 2**64 - 1, "temperature": 0.7})
    assert sampled.status_code == 200, sampled.text


def test_unpaired_surrogate_in_a_chat_message_is_the_same_400_as_in_a_query(http):
    body = b'{"model": "ragkv", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\udc80"}]}'
    chat = _error(http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}), 400)
    query = _error(http.post("/v1/query", content=b'{"question": "hi \\udc80"}', headers={"content-type": "application/json"}), 400)
    assert chat["code"] == query["code"] == "invalid_parameters"
    assert "surrogate" in chat["message"] or "unicode" in chat["message"].lower()
    paired = b'{"model": "ragkv", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}'
    assert http.post("/v1/chat/completions", content=paired, headers={"content-type": "application/json"}).status_code == 200


def test_unpaired_surrogate_in_metadata_is_refused_before_anything_is_committed(http):
    before = http.get("/v1/documents").json()["data"]
    body = b'{"text": "A note about the harbour.", "name": "note.txt", "metadata": {"k": "\\udfff"}}'
    error = _error(http.post("/v1/documents", content=body, headers={"content-type": "application/json"}), 400)
    assert "surrogate" in error["message"]
    upload = http.post("/v1/documents", files={"file": ("note.txt", b"A note about the harbour.", "text/plain")},
                       data={"metadata": '{"k": "\\udfff"}'})
    assert "surrogate" in _error(upload, 400)["message"]
    assert http.get("/v1/documents").json()["data"] == before


def test_documents_with_any_stored_metadata_still_list_and_show(server):
    headers = {"Authorization": f"Bearer {ODD_KEY}"}
    with httpx.Client(base_url=server["process"].url, headers=headers, timeout=60) as odd:
        listed = odd.get("/v1/documents")
        assert listed.status_code == 200, listed.text
        assert json.loads(listed.text)["data"][0]["metadata"] == {"k": "\udfff"}
        shown = odd.get("/v1/documents/doc_odd")
        assert shown.status_code == 200 and shown.json()["name"] == "odd.txt"


def _crashing_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    def boom():
        raise RuntimeError("an unexpected failure")

    @app.get("/port")
    def port(request: Request):
        return {"port": request.client.port}

    app.add_middleware(ServingMiddleware, metrics=Metrics(), authenticator=Authenticator({}),
                       max_body_bytes=1024, max_document_body_bytes=1024)
    return app


def test_a_500_leaves_the_keep_alive_connection_usable():
    port = free_port()
    uvicorn_server = uvicorn.Server(uvicorn.Config(_crashing_app(), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uvicorn_server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            first = client.get("/port").json()["port"]
            for _ in range(3):
                error = _error(client.get("/boom"), 500)
                assert error["code"] == "internal_error" and "an unexpected failure" not in error["message"]
                assert client.get("/port").json()["port"] == first  # the same connection, not reset
    finally:
        uvicorn_server.should_exit = True
        thread.join(10)


def test_query_refuses_a_prompt_and_answer_past_the_model_context(http):
    error = _error(http.post("/v1/query", json={**QUESTION, "top_k": 3, "max_tokens": MODEL_CONTEXT - 100}), 400)
    assert error["code"] == "context_length_exceeded" and str(MODEL_CONTEXT) in error["message"]


# -- usage and metrics ----------------------------------------------------------------------------

def _corrupt_every_chunk(db_path: Path) -> int:
    env = LMDBEnvironment(db_path)
    try:
        db = env.db(CHUNKS_DB)
        with env.read() as txn:
            blobs = {bytes(key): bytearray(value) for key, value in txn.cursor(db=db)}
        for blob in blobs.values():
            blob[len(blob) // 2] ^= 0xFF

        def write(txn) -> None:
            for key, blob in blobs.items():
                txn.put(key, bytes(blob), db=db)

        env.write(write)
        return len(blobs)
    finally:
        env.close()


def _corrupt_count(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("ragkv_store_corrupt"):
            return float(line.split()[-1])
    raise AssertionError("ragkv_store_corrupt is not exported")


def test_usage_counts_chunks_recomputed_for_a_corrupt_blob_as_computed(server, http):
    clean = http.post("/v1/query", json=QUESTION).json()["usage"]
    assert clean["recomputed_tokens"] < clean["document_tokens"] and clean["cached_tokens"] >= clean["document_tokens"] // 2
    assert _corrupt_count(http) == 0
    assert _corrupt_every_chunk(server["root"] / "data" / "db") >= 3
    after = http.post("/v1/query", json=QUESTION).json()["usage"]
    assert after["prompt_tokens"] == clean["prompt_tokens"]
    assert after["recomputed_tokens"] == after["document_tokens"]  # the whole chunk was computed again
    assert after["cached_tokens"] == clean["cached_tokens"] - (after["document_tokens"] - clean["recomputed_tokens"])
    assert after["cached_tokens"] + after["computed_tokens"] == after["prompt_tokens"]
    assert _corrupt_count(http) == 1
    again = http.post("/v1/query", json=QUESTION).json()["usage"]
    assert again == clean  # the recomputed chunk was written back


# -- validation, methods --------------------------------------------------------------------------

def test_validation_errors_are_400_in_the_openai_shape(http):
    for response in (http.post("/v1/query", json={"question": ""}),
                     http.post("/v1/query", json=["not", "an", "object"]),
                     http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0}),
                     http.post("/v1/chat/completions", json={"messages": CHAT["messages"]})):
        error = _error(response, 400)
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_parameters"


def test_response_format_json_object_is_refused_and_text_accepted(http):
    error = _error(http.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "json_object"}}), 400)
    assert error["param"] == "response_format" and "json_object" in error["message"]
    assert http.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}}).status_code == 200


def test_head_health(http):
    response = http.head("/health")
    assert response.status_code == 200 and response.content == b""


def test_safe_json_response_renders_lone_surrogates_as_escapes():
    body = SafeJSONResponse({"k": "\udfff", "ok": "é"}).body
    assert json.loads(body) == {"k": "\udfff", "ok": "é"}
    assert SafeJSONResponse({"ok": "é"}).body == '{"ok":"é"}'.encode()
