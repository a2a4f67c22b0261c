"""The API contract end to end: inputs that used to answer 500 answer 4xx with a message, a
500 leaves the keep-alive connection usable, /v1/query checks the context length, usage
counts recomputed chunks as computed, validation errors are 400.

A real `ragkv serve` (uvicorn) on a free port with an API key and an LMDB store, shared by the
tests of this module; each test leaves the server as it found it, so they run in any order.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request

from ragkv.api.auth import Authenticator
from ragkv.api.common.protocol import SEED_MAX
from ragkv.api.errors import install_error_handlers
from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.launcher import ServerProcess, free_port
from ragkv.api.metrics import Metrics
from ragkv.api.middleware import ServingMiddleware
from ragkv.engine.model_files import resolve_model_dir
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.registry import ChunkRecord, DocumentRecord
from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import CHUNKS_DB

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
KEY, ODD_KEY = "contract-key-0001", "oddity-key-00002"
MODEL_CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings


def _seed_odd_document(db_path: Path) -> None:
    """A document whose stored metadata holds a lone surrogate, as an older server let in."""
    env = LMDBEnvironment(db_path)
    try:
        record = DocumentRecord(
            "doc_odd",
            "oddity",
            "odd.txt",
            "hash_odd",
            3,
            512,
            "fp",
            time.time(),
            [ChunkRecord(0, "chunk_odd", 0, 3, 0, 11)],
            {"k": "\udfff"},
        )
        LMDBDocumentRegistry(env).add(record, "odd content", np.zeros((1, 384), dtype=np.float32))
    finally:
        env.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    keys = root / "keys.json"
    keys.write_text(json.dumps({KEY: "contract", ODD_KEY: "oddity"}))
    _seed_odd_document(root / "data" / "db")
    args = [
        "--data-dir",
        str(root / "data"),
        "--api-keys",
        str(keys),
        "--max-new-tokens",
        "8192",
        "--log-level",
        "warning",
    ]
    with ServerProcess(args, log_path=root / "serve.log") as process:
        with httpx.Client(base_url=process.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as http:
            for path in sorted(CORPUS.iterdir()):
                response = http.post("/v1/documents", json={"text": path.read_text(), "name": path.name})
                assert response.status_code == 201, response.text
        yield {"process": process, "root": root}


@pytest.fixture
def http(server):
    with httpx.Client(
        base_url=server["process"].url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300
    ) as client:
        yield client


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["message"] and body["request_id"] and "Traceback" not in response.text
    return body["error"]


QUESTION = {"question": "When was Gull Point Light first lit?", "top_k": 1, "max_tokens": 4}
CHAT = {"model": "ragkv", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


# -- what used to be a 500 ----------------------------------------------------------------------


@pytest.mark.model
def test_snapkv_capacity_below_the_rows_it_must_keep_is_400(http):
    error = _error(http.post("/v1/query", json={**QUESTION, "snapkv_capacity": 1}), 400)
    assert error["code"] == "snapkv_capacity_too_small" and "prefix and question rows" in error["message"]
    assert http.post("/v1/query", json={**QUESTION, "snapkv_capacity": 4096}).status_code == 200


@pytest.mark.model
def test_seed_outside_64_bits_is_400_and_greedy_decoding_ignores_the_seed(http):
    assert "seed" in _error(http.post("/v1/query", json={**QUESTION, "seed": 2**64}), 400)["message"]
    assert "seed" in _error(http.post("/v1/chat/completions", json={**CHAT, "seed": -(2**63) - 1}), 400)["message"]
    assert "seed" in _error(http.post("/v1/query", json={**QUESTION, "seed": SEED_MAX + 1}), 400)["message"]
    greedy = [http.post("/v1/query", json={**QUESTION, "seed": seed}).json()["answer"] for seed in (None, SEED_MAX)]
    assert greedy[0] == greedy[1]
    sampled = http.post("/v1/query", json={**QUESTION, "seed": SEED_MAX, "temperature": 0.7})
    assert sampled.status_code == 200, sampled.text


@pytest.mark.model
def test_unpaired_surrogate_in_a_chat_message_is_the_same_400_as_in_a_query(http):
    body = b'{"model": "ragkv", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\udc80"}]}'
    chat = _error(http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}), 400)
    query = _error(
        http.post("/v1/query", content=b'{"question": "hi \\udc80"}', headers={"content-type": "application/json"}), 400
    )
    assert chat["code"] == query["code"] == "invalid_parameters"
    assert "surrogate" in chat["message"] or "unicode" in chat["message"].lower()
    paired = b'{"model": "ragkv", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}'
    assert (
        http.post("/v1/chat/completions", content=paired, headers={"content-type": "application/json"}).status_code
        == 200
    )


@pytest.mark.model
def test_unpaired_surrogate_in_metadata_is_refused_before_anything_is_committed(http):
    before = http.get("/v1/documents").json()["data"]
    body = b'{"text": "A note about the harbour.", "name": "note.txt", "metadata": {"k": "\\udfff"}}'
    error = _error(http.post("/v1/documents", content=body, headers={"content-type": "application/json"}), 400)
    assert "surrogate" in error["message"]
    upload = http.post(
        "/v1/documents",
        files={"file": ("note.txt", b"A note about the harbour.", "text/plain")},
        data={"metadata": '{"k": "\\udfff"}'},
    )
    assert "surrogate" in _error(upload, 400)["message"]
    assert http.get("/v1/documents").json()["data"] == before


@pytest.mark.model
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

    app.add_middleware(
        ServingMiddleware,
        metrics=Metrics(),
        authenticator=Authenticator({}),
        max_body_bytes=1024,
        max_document_body_bytes=1024,
    )
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


@pytest.mark.model
def test_query_refuses_a_prompt_and_answer_past_the_model_context(http):
    error = _error(http.post("/v1/query", json={**QUESTION, "top_k": 3, "max_tokens": MODEL_CONTEXT - 100}), 400)
    assert error["code"] == "context_length_exceeded" and str(MODEL_CONTEXT) in error["message"]


# -- usage and metrics ----------------------------------------------------------------------------


def _chunk_blobs(db_path: Path) -> dict[bytes, bytes]:
    env = LMDBEnvironment(db_path)
    try:
        db = env.db(CHUNKS_DB)
        with env.read() as txn:
            return {bytes(key): bytes(value) for key, value in txn.cursor(db=db)}
    finally:
        env.close()


def _write_chunk_blobs(db_path: Path, blobs: dict[bytes, bytes]) -> None:
    env = LMDBEnvironment(db_path)
    try:
        db = env.db(CHUNKS_DB)

        def write(txn) -> None:
            for key, blob in blobs.items():
                txn.put(key, blob, db=db)

        env.write(write)
    finally:
        env.close()


def _flipped(blob: bytes) -> bytes:
    corrupt = bytearray(blob)
    corrupt[len(corrupt) // 2] ^= 0xFF
    return bytes(corrupt)


def _corrupt_count(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("ragkv_store_corrupt"):
            return float(line.split()[-1])
    raise AssertionError("ragkv_store_corrupt is not exported")


@pytest.mark.model
def test_usage_counts_chunks_recomputed_for_a_corrupt_blob_as_computed(server, http):
    clean = http.post("/v1/query", json=QUESTION).json()["usage"]
    assert (
        clean["recomputed_tokens"] < clean["document_tokens"]
        and clean["cached_tokens"] >= clean["document_tokens"] // 2
    )
    corrupt_before = _corrupt_count(http)
    db_path = server["root"] / "data" / "db"
    originals = _chunk_blobs(db_path)
    assert len(originals) >= 3
    _write_chunk_blobs(db_path, {key: _flipped(blob) for key, blob in originals.items()})
    try:
        after = http.post("/v1/query", json=QUESTION).json()["usage"]
        assert after["prompt_tokens"] == clean["prompt_tokens"]
        assert after["recomputed_tokens"] == after["document_tokens"]  # the whole chunk was computed again
        cached = clean["cached_tokens"] - (after["document_tokens"] - clean["recomputed_tokens"])
        assert after["cached_tokens"] == cached
        assert after["cached_tokens"] + after["computed_tokens"] == after["prompt_tokens"]
        assert _corrupt_count(http) == corrupt_before + 1
        again = http.post("/v1/query", json=QUESTION).json()["usage"]
        assert again == clean  # the recomputed chunk was written back
    finally:
        _write_chunk_blobs(db_path, originals)  # the other tests read an intact store


# -- validation, methods --------------------------------------------------------------------------


@pytest.mark.model
def test_validation_errors_are_400_in_the_openai_shape(http):
    for response in (
        http.post("/v1/query", json={"question": ""}),
        http.post("/v1/query", json=["not", "an", "object"]),
        http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0}),
        http.post("/v1/chat/completions", json={"messages": CHAT["messages"]}),
    ):
        error = _error(response, 400)
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_parameters"


@pytest.mark.model
def test_response_format_json_object_is_refused_and_text_accepted(http):
    error = _error(http.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "json_object"}}), 400)
    assert error["param"] == "response_format" and "json_object" in error["message"]
    assert http.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}}).status_code == 200


@pytest.mark.model
def test_head_health(http):
    response = http.head("/health")
    assert response.status_code == 200 and response.content == b""


def test_safe_json_response_renders_lone_surrogates_as_escapes():
    body = SafeJSONResponse({"k": "\udfff", "ok": "é"}).body
    assert json.loads(body) == {"k": "\udfff", "ok": "é"}
    assert SafeJSONResponse({"ok": "é"}).body == '{"ok":"é"}'.encode()


# -- OpenAI completions and embeddings, LangChain -------------------------------------------------


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["process"].url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.mark.model
def test_completions_continue_the_prompt_as_transformers_greedy_does(server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "The lighthouse keeper climbed the stairs and"
    ids = tokenizer(text)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        generated = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
    expected = tokenizer.decode(generated, skip_special_tokens=True)

    client = _openai(server)
    by_ids = client.completions.create(model="ragkv", prompt=ids, max_tokens=8)
    assert by_ids.object == "text_completion" and by_ids.choices[0].text == expected
    assert (
        by_ids.usage.prompt_tokens == len(ids)
        and by_ids.usage.total_tokens == len(ids) + by_ids.usage.completion_tokens
    )
    by_text = client.completions.create(model="ragkv", prompt=text, max_tokens=8)
    assert by_text.choices[0].text == expected

    other = "Apples grow best on slopes where"
    batch = client.completions.create(model="ragkv", prompt=[text, other], max_tokens=4)
    single = client.completions.create(model="ragkv", prompt=other, max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[1].text == single.choices[0].text

    chunks = list(
        client.completions.create(
            model="ragkv", prompt=text, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == by_ids.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


@pytest.mark.model
def test_completions_with_rag_answer_like_query_with_citations(server, http):
    client = _openai(server)
    answer = client.completions.create(
        model="ragkv", prompt=QUESTION["question"], max_tokens=4, extra_body={"rag": {"enabled": True, "top_k": 1}}
    )
    choice = answer.model_dump()["choices"][0]
    query = http.post("/v1/query", json=QUESTION).json()
    assert choice["text"] == query["answer"] and choice["rag"]["citations"] == query["citations"]
    assert answer.usage.prompt_tokens == query["usage"]["prompt_tokens"]


@pytest.mark.model
def test_completions_refuse_what_they_do_not_serve(server, http):
    with pytest.raises(openai.BadRequestError):
        _openai(server).completions.create(model="ragkv", prompt="x", max_tokens=2, echo=True)
    error = _error(
        http.post("/v1/completions", json={"model": "ragkv", "prompt": "x", "max_tokens": MODEL_CONTEXT}), 400
    )
    assert error["code"] == "context_length_exceeded"
    assert (
        _error(http.post("/v1/completions", json={"model": "gpt-3.5", "prompt": "x"}), 404)["code"] == "model_not_found"
    )
    assert (
        _error(http.post("/v1/completions", json={"model": "ragkv", "prompt": [10**9]}), 400)["code"] == "bad_token_id"
    )


@pytest.mark.model
def test_embeddings_match_the_packaged_embedder(server, http):
    texts = ["Gull Point Light was first lit in 1871.", "Apples grow on the south-facing slope."]
    expected = Embedder().embed_passages(texts)
    response = _openai(server).embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the client asks for base64
    assert [item.index for item in response.data] == [0, 1] and response.model == "all-MiniLM-L6-v2"
    np.testing.assert_allclose(np.array([item.embedding for item in response.data]), expected, atol=1e-5)
    assert response.usage.prompt_tokens == response.usage.total_tokens > 2 * 8
    floats = http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": texts[0]}).json()
    np.testing.assert_allclose(floats["data"][0]["embedding"], expected[0], atol=1e-5)
    assert _error(http.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "x"}), 404)
    assert _error(http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x", "dimensions": 8}), 400)
    assert {m.id for m in _openai(server).models.list().data} >= {"all-MiniLM-L6-v2"}


@pytest.mark.model
def test_langchain_sees_numbered_sources_and_the_session(server, http):
    from langchain_openai import ChatOpenAI

    def chat(**extra) -> ChatOpenAI:
        return ChatOpenAI(
            model="ragkv",
            base_url=server["process"].url + "/v1",
            api_key=KEY,
            max_tokens=6,
            temperature=0,
            max_retries=0,
            extra_body={"sources": True, "rag": {"top_k": 2}, **extra},
        )

    message = chat().invoke("When was Gull Point Light first lit?")
    assert "[1][2]" in message.content and "\n\nSources:\n[1] lighthouses.md, chunk 0 (doc_" in message.content
    session = re.search(r"Session: (\S+)", message.content).group(1)
    follow = "".join(chunk.content for chunk in chat(session_id=session).stream("Who was its last keeper?"))
    assert follow.endswith(f"Session: {session}")
    raw = http.post(
        "/v1/chat/completions",
        json={
            **CHAT,
            "sources": True,
            "rag": {"top_k": 2},
            "messages": [{"role": "user", "content": "Tell me about Linden Gold."}],
        },
    ).json()
    content, citations = raw["choices"][0]["message"]["content"], raw["rag"]["citations"]
    for number, citation in enumerate(citations, 1):
        assert f"[{number}] {citation['name']}, chunk {citation['chunk_index']} ({citation['document_id']})" in content
    plain = http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    assert "Sources:" not in plain


# -- OpenAPI document and offline docs -----------------------------------------------------------


@pytest.mark.model
def test_openapi_declares_bodies_errors_and_bearer_auth(http):
    schema = http.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schema["components"]["securitySchemes"]["bearerAuth"]["description"],
    }
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "HTTPValidationError" not in str(responses.get("422", "")), (method, path)  # validation: 400
            assert any(code.startswith("2") and responses[code].get("content") for code in responses), (method, path)
            if path.startswith("/v1/"):
                assert operation["security"] == [{"bearerAuth": []}] and "401" in responses, (method, path)
            for code, response in responses.items():
                if code[0] in "45" and path != "/health":  # /health answers 503 with its report
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorResponse"), (method, path, code)
    upload = schema["paths"]["/v1/documents"]["post"]["requestBody"]["content"]
    assert upload["multipart/form-data"]["schema"]["properties"]["file"]["format"] == "binary"
    assert upload["application/json"]["schema"]["$ref"].endswith("/DocumentCreate")
    chat = schema["components"]["schemas"]["ChatRequest"]["properties"]
    assert len(chat) >= 13 and all(field.get("description") for field in chat.values())


@pytest.mark.model
def test_docs_page_loads_swagger_from_the_server_itself(http):
    page = http.get("/docs")
    assert page.status_code == 200
    assets = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page.text)
    assert assets and all(asset.startswith("/") for asset in assets), assets  # nothing from another host
    for asset in assets:
        response = http.get(asset)
        assert response.status_code == 200 and len(response.content) > 100, asset
