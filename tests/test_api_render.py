"""vLLM's render calls against the shared `ragkv serve` (tests/conftest.py):
POST /v1/chat/completions/render and /v1/completions/render answer vLLM's GenerateRequest,
whose token ids are the prompt the request would prefill. The references: the packaged
model's own tokenizer and chat template (the text the ids spell), and the server itself (a
completion of exactly those ids answers as the chat does, over as many prompt tokens)."""

from __future__ import annotations

import httpx
import pytest

from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT

pytestmark = pytest.mark.model

# vllm.entrypoints.serve.disagg.protocol.GenerateRequest's fields
GENERATE_REQUEST_FIELDS = {
    "request_id",
    "token_ids",
    "features",
    "sampling_params",
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
}
MESSAGES = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "  Why that one?"},
]
PLAIN = {"rag": {"enabled": False}, "prompt_spans": False}  # the prompt as sent: no retrieval, no stored passages


@pytest.fixture(scope="module")
def http(shared_server):
    key = shared_server.key["render"]
    with httpx.Client(base_url=shared_server.url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from ragkv.engine.model_files import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def _ok(response: httpx.Response):
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_render_gives_the_ids_the_chat_prefills(http, tokenizer):
    body = {"model": "ragkv", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, **PLAIN}
    rendered = _ok(http.post("/v1/chat/completions/render", json={**body, "cache_salt": "team-a"}))
    assert set(rendered) == GENERATE_REQUEST_FIELDS
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["model"] == "ragkv"
    assert rendered["features"] is None and rendered["stream"] is False and rendered["cache_salt"] == "team-a"
    sampling = rendered["sampling_params"]
    assert (sampling["max_tokens"], sampling["temperature"], sampling["n"]) == (6, 0.0, 1)
    ids = rendered["token_ids"]
    system = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}]
    template = tokenizer.apply_chat_template(system + MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids) == template  # the model's own template, every role kept

    chat = _ok(http.post("/v1/chat/completions", json=body))
    assert chat["usage"]["prompt_tokens"] == len(ids)
    completion = _ok(
        http.post(
            "/v1/completions",
            json={"model": "ragkv", "prompt": ids, "max_tokens": 6, "temperature": 0, "prompt_spans": False},
        )
    )
    assert completion["usage"]["prompt_tokens"] == len(ids)
    # the same ids prefilled: greedy decoding gives the same answer
    assert completion["choices"][0]["text"].strip() == chat["choices"][0]["message"]["content"].strip()


def test_completion_render_gives_each_prompts_ids(http, tokenizer):
    texts = ["The capital of France is", "Two and two make"]
    body = {"model": "ragkv", "prompt": texts, "max_tokens": 3, "stream": True, "prompt_spans": False}
    rendered = _ok(http.post("/v1/completions/render", json=body))
    assert [set(entry) for entry in rendered] == [GENERATE_REQUEST_FIELDS] * 2
    assert [entry["token_ids"] for entry in rendered] == [
        tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts
    ]
    assert all(entry["request_id"].startswith("cmpl-") and entry["stream"] is True for entry in rendered)
    given = [1, 2, 3, 4]
    [as_given] = _ok(http.post("/v1/completions/render", json={**body, "prompt": given}))
    assert as_given["token_ids"] == given
    completion = _ok(http.post("/v1/completions", json={**body, "prompt": texts[0], "stream": False}))
    assert completion["usage"]["prompt_tokens"] == len(rendered[0]["token_ids"])


def test_render_refuses_what_the_request_would(http):
    def error(path: str, body: dict, status: int) -> dict:
        response = http.post(path, json=body)
        assert response.status_code == status, response.text
        return response.json()["error"]

    chat = {"model": "ragkv", "messages": MESSAGES}
    assert error("/v1/chat/completions/render", {**chat, "model": "gpt-4"}, 404)["code"] == "model_not_found"
    too_long = {**chat, "messages": [{"role": "user", "content": "word " * 9000}]}
    assert error("/v1/chat/completions/render", too_long, 400)["code"] == "context_length_exceeded"
    completion = {"model": "ragkv", "prompt": "Hello"}
    two_questions = {**completion, "prompt": ["Hello", "Why?"], "rag": {"enabled": True}}
    assert error("/v1/completions/render", two_questions, 400)["code"] == "unsupported_prompt"
    assert error("/v1/completions/render", {**completion, "prompt": [10**9]}, 400)["code"] == "bad_token_id"


def test_completion_render_of_a_question_is_its_prompt_around_no_documents(http, tokenizer):
    from ragkv.engine.prompt import ChatPrompt

    question = "Which colour is the sky?"
    body = {"model": "ragkv", "prompt": question, "max_tokens": 4, "rag": {"enabled": True}}
    [rendered] = _ok(http.post("/v1/completions/render", json=body))
    segments = ChatPrompt(tokenizer).rag_segments(question)
    assert rendered["token_ids"] == segments.prefix_ids + segments.question_ids


def test_a_conversation_not_ending_with_a_user_message_is_answered_as_one_with_an_empty_one(http, tokenizer):
    ending = MESSAGES[:2]  # ends with the assistant's message: OpenAI answers it too
    rendered = _ok(http.post("/v1/chat/completions/render", json={"model": "ragkv", "messages": ending}))
    empty = _ok(
        http.post(
            "/v1/chat/completions/render",
            json={"model": "ragkv", "messages": [*ending, {"role": "user", "content": ""}]},
        )
    )
    assert rendered["token_ids"] == empty["token_ids"]
    answer = _ok(
        http.post("/v1/chat/completions", json={"model": "ragkv", "messages": ending, "max_tokens": 2, **PLAIN})
    )
    assert answer["usage"]["prompt_tokens"] == len(rendered["token_ids"])
