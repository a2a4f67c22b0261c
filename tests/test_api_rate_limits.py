"""Limits per API key against the shared `ragkv serve` (tests/conftest.py), whose keys file
gives some keys their own limits: a key past its request rate or its requests in progress
gets 429 with Retry-After (the OpenAI shape, so the openai client raises RateLimitError),
while the other keys are served meanwhile."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

pytestmark = pytest.mark.model

QUERY_BODY_BYTES = 64


def _get_models(url: str, key: str) -> httpx.Response:
    return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _until(status: int, url: str, key: str, deadline_s: float = 120.0) -> httpx.Response:
    """GET /v1/models with `key` until it answers `status` (the condition, not a time, ends the wait)."""
    deadline = time.monotonic() + deadline_s
    while True:
        response = _get_models(url, key)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def _assert_429(response: httpx.Response, code: str) -> int:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", code), error
    retry_after = int(response.headers["retry-after"])
    assert retry_after >= 1
    return retry_after


def test_a_key_past_its_rate_gets_429_while_another_key_is_served(shared_server):
    url, a, b = shared_server.url, shared_server.key["rate-a"], shared_server.key["rate-b"]
    assert _get_models(url, a).status_code == 200  # a's one request this hour
    retry_after = _assert_429(_get_models(url, a), "rate_limit_exceeded")
    assert 3500 < retry_after <= 3600
    # b's allowance is its own: its one request this hour does model work while a is refused
    answer = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "ragkv", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {b}"},
        timeout=300,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=a, max_retries=0, timeout=60.0)
    with pytest.raises(openai.RateLimitError) as refused:
        client.models.list()
    assert refused.value.response.headers["retry-after"]
    _assert_429(_get_models(url, b), "rate_limit_exceeded")  # now b is past its rate too


def test_a_key_with_a_request_in_progress_gets_429_until_it_finishes(shared_server):
    url, key, peer = shared_server.url, shared_server.key["one-at-a-time"], shared_server.key["unlimited-peer"]
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as held:
        # A request whose body has not arrived yet is in progress: it holds the key's one slot.
        head = (
            "POST /v1/query HTTP/1.1\r\n"
            f"Host: {parts.netloc}\r\n"
            f"Authorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {QUERY_BODY_BYTES}\r\n\r\n"
        )
        held.sendall(head.encode())
        _assert_429(_until(429, url, key), "concurrency_limit_exceeded")
        assert _get_models(url, peer).status_code == 200  # another key is served meanwhile
        held.sendall(json.dumps({}).ljust(QUERY_BODY_BYTES).encode())  # no question: a 400, quickly
        assert held.recv(4096).startswith(b"HTTP/1.1 400 ")
    assert _until(200, url, key).status_code == 200  # the slot is free again


def _jobs(url: str) -> float:
    """Model worker jobs so far, every kind and outcome (a request refused before it is
    queued is none; one that fails once it runs is one)."""
    lines = httpx.get(url + "/metrics", timeout=60).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("ragkv_worker_jobs_total"))


def _refused(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error["message"]


def test_a_prompt_or_body_past_the_limits_is_refused_before_any_model_work(shared_server):
    url, key = shared_server.url, shared_server.key["unlimited-peer"]
    headers = {"Authorization": f"Bearer {key}"}
    long = "word " * 3000  # three of them pass the packaged model's 8K context
    history = [{"role": "user", "content": long}, {"role": "assistant", "content": long}]
    messages = history + [{"role": "user", "content": long}, {"role": "user", "content": "Why?"}]
    before = _jobs(url)
    for path in ("/v1/chat/completions", "/v1/chat/completions/render"):
        body = {"model": "ragkv", "messages": messages, "max_tokens": 4}
        message = _refused(
            httpx.post(url + path, json=body, headers=headers, timeout=120), 400, "context_length_exceeded"
        )
        assert "the conversation is" in message and "above the model's context of 8192" in message
    completion = {"model": "ragkv", "prompt": long * 3, "max_tokens": 4}
    response = httpx.post(url + "/v1/completions", json=completion, headers=headers, timeout=120)
    assert "above the model's context of 8192" in _refused(response, 400, "context_length_exceeded")
    oversized = {"model": "ragkv", "prompt": "x" * (1 << 20), "max_tokens": 4}  # over --max-body-kb's 1024
    response = httpx.post(url + "/v1/completions", json=oversized, headers=headers, timeout=120)
    assert "(--max-body-kb)" in _refused(response, 413, "body_too_large")
    assert _jobs(url) == before  # none reached the model worker
