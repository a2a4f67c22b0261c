"""Two replicas sharing one corpus: two real `ragkv serve` processes with their own data
folders (as on two hosts) and one real redis-server holding the chunk tier (db 0), the
document registry (db 1) and the chat sessions (db 2).

A document ingested through one replica is listed, retrieved, cited and deleted through
the other; a chat session started on one continues on the other, and so does a follow-up
sent at once after an anonymous turn, whole or by the id its answer named; with the Redis gone,
the registry's failure is a 503 and a degraded /health, not a 500. Replica A logs JSON,
so its access lines are checked too.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from redis_server import RedisServer

from ragkv.api.launcher import ServerProcess
from ragkv.bench.replica_followup_bench import metric_value
from ragkv.bench.replicas import replica, start_all
from ragkv.engine.model_files import resolve_model_dir

pytestmark = [pytest.mark.model, pytest.mark.redis]

TEXT = (
    "The Tidewater Ferry between Marsh Harbor and Eel Island was launched in 1911. Its captain, "
    "Ada Quillfeather, kept the ferry running through the great storm of 1923. The crossing takes "
    "forty minutes and the ferry carries twelve cars."
)
QUESTION = "Who was the captain of the Tidewater Ferry?"


def _counter(http: httpx.Client, name: str) -> float:
    """A sample's value on /metrics (a missing one fails the test)."""
    value = metric_value(http, name)
    assert value is not None, f"{name} is not exported"
    return value


def _json_log(server: ServerProcess) -> list[dict]:
    return [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    redis_server = RedisServer()
    redis_server.start()
    servers = [replica(root, name, redis_server.url, ("--log-format", "json")) for name in ("a", "b")]
    try:
        start_all(servers)
        yield servers, redis_server
    finally:
        for server in servers:
            server.stop()
        redis_server.cleanup()


def test_a_document_ingested_on_one_replica_is_answered_with_citations_on_the_other(replicas):
    (a, b), _ = replicas
    with httpx.Client(base_url=a.url, timeout=180) as http_a, httpx.Client(base_url=b.url, timeout=180) as http_b:
        created = http_a.post("/v1/documents", json={"text": TEXT, "name": "ferry.txt"})
        assert created.status_code == 201, created.text
        doc_id = created.json()["document"]["id"]
        assert [doc["id"] for doc in http_b.get("/v1/documents").json()["data"]] == [doc_id]
        assert http_b.get(f"/v1/documents/{doc_id}", params={"include_text": "true"}).json()["text"] == TEXT

        answered = http_b.post("/v1/query", json={"question": QUESTION, "top_k": 1, "max_tokens": 4})
        assert answered.status_code == 200, answered.text
        body = answered.json()
        citation = body["citations"][0]
        assert citation["document_id"] == doc_id and "Quillfeather" in citation["text"]
        assert body["usage"]["cached_tokens"] > 0  # replica A's chunk KV, read from the shared Redis tier

        assert http_b.delete(f"/v1/documents/{doc_id}").status_code == 200
        assert http_a.get("/v1/documents").json()["data"] == []
        assert http_a.get(f"/v1/documents/{doc_id}").status_code == 404

    started = next(entry for entry in _json_log(a) if entry["message"].startswith("serving"))
    assert "registry redis" in started["message"] and "sessions redis" in started["message"]
    access = next(entry for entry in _json_log(a) if entry.get("request_id") == created.headers["x-request-id"])
    assert (
        access["logger"] == "ragkv.access"
        and (access["method"], access["path"], access["status"]) == ("POST", "/v1/documents", 201)
        and access["tenant"] == "default"
        and access["latency_ms"] > 0
    )


def test_a_chat_session_started_on_one_replica_continues_on_the_other(replicas):
    (a, b), _ = replicas
    with httpx.Client(base_url=a.url, timeout=180) as http:
        assert http.post("/v1/documents", json={"text": TEXT, "name": "ferry.txt"}).status_code == 201
    client_a = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0)
    first = client_a.chat.completions.create(
        model="ragkv", max_tokens=4, extra_body={"rag": {"top_k": 1}}, messages=[{"role": "user", "content": QUESTION}]
    )
    assert first.rag["turn"] == 1 and first.rag["citations"][0]["name"] == "ferry.txt"
    # Sending the id back makes the context a named session, kept in the shared session store.
    second = client_a.chat.completions.create(
        model="ragkv",
        max_tokens=4,
        extra_body={"session_id": first.session_id, "rag": {"enabled": False}},
        messages=[{"role": "user", "content": "Who runs it?"}],
    )
    assert second.session_id == first.session_id and second.rag["turn"] == 2
    third = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model="ragkv",
        max_tokens=4,
        extra_body={"session_id": first.session_id, "rag": {"enabled": False}},
        messages=[{"role": "user", "content": "In which year was it launched?"}],
    )
    assert third.session_id == first.session_id and third.rag["turn"] == 3
    cached = third.usage.prompt_tokens_details.cached_tokens
    assert cached >= second.usage.prompt_tokens  # turns 1-2's KV, from the shared session store


def _chat_tokens(messages: list[dict[str, str]], generation_prompt: bool) -> int:
    """Tokens of `messages` through the served model's own chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt))


def _stream_turn(base_url: str, body: dict) -> tuple[dict, dict, str]:
    """A streamed chat turn read to [DONE]: the final chunk, the usage chunk and the text."""
    body = {**body, "model": "ragkv", "stream": True, "stream_options": {"include_usage": True}}
    with (
        httpx.Client(base_url=base_url, timeout=180) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    final = next(event for event in events if event["choices"] and event["choices"][0]["finish_reason"])
    text = "".join(event["choices"][0]["delta"].get("content") or "" for event in events if event["choices"])
    return final, events[-1]["usage"], text


def test_a_follow_up_sent_at_once_to_the_other_replica_reuses_the_first_turns_kv(replicas):
    """No session id, as an OpenAI client behind a round-robin balancer: turn 1 on A, the whole
    history resent to B the moment turn 1's answer ends. A's answer ends only once its context
    is in Redis, so B finds it by the conversation's prefix and computes only the new message."""
    (a, b), _ = replicas
    with httpx.Client(base_url=a.url, timeout=180) as http:
        assert http.post("/v1/documents", json={"text": TEXT, "name": "ferry.txt"}).status_code == 201
    history = [
        {"role": "system", "content": "You answer questions about ferries, harbours and islands. " * 60},
        {"role": "user", "content": QUESTION},
    ]
    with httpx.Client(base_url=b.url, timeout=60) as http:
        hits_before = _counter(http, "ragkv_shared_context_hits_total")
    first = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model="ragkv", max_tokens=8, messages=history
    )
    assert first.rag["session"]["shared"] is True  # in Redis before the answer was sent
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Say that again, briefly."},
    ]
    follow_up = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model="ragkv", max_tokens=8, messages=history
    )
    cached, prompt = follow_up.usage.prompt_tokens_details.cached_tokens, follow_up.usage.prompt_tokens
    # The bar lets through the new message with its template, and nothing of turn 1; the
    # history is long enough for that to hold (counted by the model's own tokenizer).
    new_message = _chat_tokens(history, True) - _chat_tokens(history[:-1], False)
    assert new_message <= 0.05 * _chat_tokens(history, True)
    assert prompt - cached <= 0.05 * prompt, (cached, prompt)
    assert follow_up.choices[0].message.content
    with httpx.Client(base_url=b.url, timeout=60) as http:
        assert _counter(http, "ragkv_shared_context_hits_total") == hits_before + 1


def test_the_id_an_anonymous_answer_names_continues_on_the_other_replica(replicas):
    """Turn 1 without a session id on A (streamed); its answer names an id. Sent at once to B
    with only the new message, that id continues the conversation there (B reads A's published
    context by id), and back on A it continues B's turn."""
    (a, b), _ = replicas
    question = "Name one thing a ferry captain does every day."
    final, usage, text = _stream_turn(
        a.url, {"max_tokens": 8, "rag": {"enabled": False}, "messages": [{"role": "user", "content": question}]}
    )
    session_id = final["session_id"]
    assert text and final["rag"]["turn"] == 1 and final["rag"]["session"]["shared"] is True
    second = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model="ragkv",
        max_tokens=8,
        extra_body={"session_id": session_id, "rag": {"enabled": False}},
        messages=[{"role": "user", "content": "And every night?"}],
    )
    assert second.session_id == session_id and second.rag["turn"] == 2
    assert second.usage.prompt_tokens_details.cached_tokens >= usage["prompt_tokens"]  # turn 1's rows, from A
    assert second.choices[0].message.content
    third = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model="ragkv",
        max_tokens=8,
        extra_body={"session_id": session_id, "rag": {"enabled": False}},
        messages=[{"role": "user", "content": "Thanks."}],
    )
    assert third.rag["turn"] == 3
    assert third.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens  # B's turn, from Redis
    with httpx.Client(base_url=b.url, timeout=60) as http:
        assert _counter(http, "ragkv_shared_context_loaded_total") >= 1
        unknown = http.post(
            "/v1/chat/completions",
            json={"model": "ragkv", "session_id": "sess_never_named", "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "session_not_found"


def test_registry_down_is_a_503_and_a_degraded_health(replicas):
    (a, _), redis_server = replicas
    redis_server.stop()
    try:
        with httpx.Client(base_url=a.url, timeout=60) as http:
            listed = http.get("/v1/documents")
            assert listed.status_code == 503 and listed.json()["error"]["code"] == "registry_unavailable"
            assert "Traceback" not in listed.text
            health = http.get("/health").json()
            assert health["status"] == "degraded" and health["registry"] == {"backend": "redis", "redis_up": False}
            assert any(problem.startswith("registry:") for problem in health["problems"])
            assert 'ragkv_redis_up{role="registry"} 0.0' in http.get("/metrics").text
    finally:
        redis_server.start()
    with httpx.Client(base_url=a.url, timeout=60) as http:
        assert http.get("/v1/documents").status_code == 200  # reconnected (the test server keeps no data)
