"""The API end to end: a real `ragkv serve` (uvicorn) on a free port, a real redis-server,
the openai client against /v1/chat/completions, tenants, bad inputs, a second replica
sharing chunks and sessions through Redis, and Redis killed mid-run.

The tests of this module share one server; what a test needs from earlier work (the
ingested corpus, a two-turn chat session) comes from module fixtures, so each test also
passes when run alone. Token counts are derived from the packaged model's tokenizer and
chat template (`chat_prompt`), not written in.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from redis_server import RedisServer

from ragkv.api.launcher import ServerProcess
from ragkv.engine.prompt import ChatPrompt

pytestmark = [pytest.mark.model, pytest.mark.redis]

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
ALPHA, BETA, GAMMA = "alpha-key-0001", "beta-key-00002", "gamma-key-0003"
MODEL = "ragkv"  # alias the server accepts besides its model folder's name


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


def _serve_args(root: Path, name: str, redis_url: str, keys: Path) -> list[str]:
    data = root / name
    return [
        "--data-dir",
        str(data),
        "--store",
        f"tiered+lmdb://{data}/db?redis={redis_url}",
        "--api-keys",
        str(keys),
        "--max-body-kb",
        "64",
        "--max-document-body-mb",
        "1",
        "--background-ingest-bytes",
        "4000",
        "--log-level",
        "warning",
    ]


@pytest.fixture(scope="module")
def env(tmp_path_factory, redis_server):
    root = tmp_path_factory.mktemp("api")
    keys = root / "keys.json"
    keys.write_text(json.dumps({ALPHA: "alpha", BETA: "beta", GAMMA: "gamma"}))
    server = ServerProcess(_serve_args(root, "a", redis_server.url, keys), log_path=root / "a.log").start(
        timeout_s=600
    )  # a loaded CI machine is slow
    yield {"root": root, "keys": keys, "server": server, "redis": redis_server}
    server.stop()


@pytest.fixture(scope="module")
def chat_prompt() -> ChatPrompt:
    """The server's prompt layout, from the packaged model's tokenizer and chat template."""
    from transformers import AutoTokenizer

    from ragkv.engine.model_files import resolve_model_dir

    return ChatPrompt(AutoTokenizer.from_pretrained(resolve_model_dir(None)))


@pytest.fixture(scope="module")
def corpus(env) -> dict:
    """The example corpus ingested as alpha (the answers, by file name), and orchard.txt
    uploaded as a multipart file by beta (under "beta:orchard.txt")."""
    answers = {}
    with client(env) as http:
        for path in sorted(CORPUS.iterdir()):
            response = http.post(
                "/v1/documents", json={"text": path.read_text(), "name": path.name, "metadata": {"source": "examples"}}
            )
            assert response.status_code == 201, response.text
            answers[path.name] = response.json()
    with client(env, BETA) as http, open(CORPUS / "orchard.txt", "rb") as handle:
        response = http.post(
            "/v1/documents",
            files={"file": ("orchard.txt", handle, "text/plain")},
            data={"metadata": json.dumps({"owner": "beta"})},
        )
        assert response.status_code == 201, response.text
        answers["beta:orchard.txt"] = response.json()
    return answers


@pytest.fixture(scope="module")
def docs(corpus) -> dict[str, str]:
    """alpha's document ids by file name."""
    return {name: body["document"]["id"] for name, body in corpus.items() if not name.startswith("beta:")}


FIRST_QUESTION = "When was Gull Point Light first lit?"
FOLLOW_UP = "Who was its last resident keeper?"


@pytest.fixture(scope="module")
def chat_session(env, docs) -> SimpleNamespace:
    """alpha's two-turn chat over the corpus: turn 1 plain, turn 2 streamed in the session
    with the whole history resent (`first`, the streamed `chunks`, the session's `id`)."""
    chat = openai_client(env)
    first = chat.chat.completions.create(
        model=MODEL,
        max_tokens=8,
        extra_body={"rag": {"top_k": 5}},
        messages=[{"role": "user", "content": FIRST_QUESTION}],
    )
    stream = chat.chat.completions.create(
        model=MODEL,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"session_id": first.session_id, "rag": {"top_k": 5}},
        messages=[
            {"role": "user", "content": FIRST_QUESTION},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": FOLLOW_UP},
        ],
    )
    return SimpleNamespace(id=first.session_id, first=first, chunks=list(stream))


def client(env, key: str | None = ALPHA, timeout: float = 180.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=env["server"].url, headers=headers, timeout=timeout)


def openai_client(env, key: str = ALPHA, url: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=(url or env["server"].url) + "/v1", api_key=key, max_retries=0, timeout=180.0)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["message"] and body["request_id"] and "Traceback" not in response.text
    return body["error"]


# -- health, documents, jobs -----------------------------------------------------------------


def test_health_and_models(env):
    with client(env, key=None) as http:
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["store"]["redis_up"] is True
        assert health["sessions"] == {"backend": "redis", "redis_up": True}
        _error(http.get("/v1/models"), 401)
    models = openai_client(env).models.list()
    assert len(models.data) == 2 and models.data[0].owned_by == "ragkv"


def test_ingest_corpus_and_read_documents(env, corpus):
    ids = {}
    for name, body in corpus.items():
        assert body["ingest"]["computed_chunks"] == body["document"]["chunks"] == 1
        ids[name] = body["document"]["id"]
    # beta's upload computed its chunk again: chunk keys are salted per tenant by default
    beta_id = ids.pop("beta:orchard.txt")
    with client(env) as http:
        listed = http.get("/v1/documents").json()["data"]
        names = {doc_id: name for name, doc_id in ids.items()}
        assert {doc["id"]: doc["name"] for doc in listed if doc["id"] in names} == names
        assert beta_id not in {doc["id"] for doc in listed}
        shown = http.get(f"/v1/documents/{ids['orchard.txt']}", params={"include_text": "true"}).json()
        assert (
            shown["metadata"] == {"source": "examples"}
            and "Linden Hill" in shown["text"]
            and shown["chunks"][0]["index"] == 0
        )
    with client(env, BETA) as http:
        assert http.get(f"/v1/documents/{beta_id}").json()["metadata"] == {"owner": "beta"}


def test_large_document_ingests_as_a_background_job(env):
    text = "\n\n".join(
        f"Logbook entry {i}: the keeper of Stormhead Light recorded wind from the {d} at force {i % 9}, "
        f"{i * 3} vessels passing, and lamp oil use of {i * 7} litres over the night."
        for i, d in zip(range(30), ["north", "east", "south", "west"] * 8)
    )
    assert len(text.encode()) > 4000  # past --background-ingest-bytes, and over two chunks
    with client(env) as http:
        try:
            response = http.post("/v1/documents", json={"text": text, "name": "logbook.txt"})
            assert response.status_code == 202, response.text
            job_id = response.json()["job"]["id"]
            assert response.headers["location"] == f"/v1/jobs/{job_id}"
            deadline, job = time.monotonic() + 600, {}  # a bound, not a timing: generous on a loaded machine
            while time.monotonic() < deadline:
                job = http.get(f"/v1/jobs/{job_id}").json()
                if job["status"] not in ("queued", "running"):
                    break
                time.sleep(0.2)
            assert job["status"] == "succeeded", job
            chunks = job["result"]["document"]["chunks"]
            assert chunks >= 2 and job["progress"]["chunks_done"] == job["progress"]["chunks_total"] == chunks
            doc_id = job["result"]["document"]["id"]
            with client(env, BETA) as other:
                _error(other.get(f"/v1/jobs/{job_id}"), 404)
                _error(other.delete(f"/v1/documents/{doc_id}"), 404)
            deleted = http.delete(f"/v1/documents/{doc_id}").json()
            assert deleted == {"id": doc_id, "object": "document", "deleted": True}
            _error(http.get(f"/v1/documents/{doc_id}"), 404)
        finally:  # gone even when an assert failed, so the other tests retrieve what they expect
            for doc in http.get("/v1/documents").json()["data"]:
                if doc["name"] == "logbook.txt":
                    http.delete(f"/v1/documents/{doc['id']}")


def test_put_replaces_a_document_in_place_and_pdf_citations_name_the_page(env):
    from document_files import PAGE_FACTS, pdf_bytes

    # pages longer than a chunk (512 tokens), so the chunk holding a page's last line starts on that
    # page; the ferry's on page 2 of two
    filler = "The annual report continues with routine figures about staffing and budgets. " * 42
    pdf = pdf_bytes([filler + PAGE_FACTS[0], filler + PAGE_FACTS[2]])
    with client(env, BETA) as http:
        created = http.post(
            "/v1/documents", json={"text": "A first draft. " * 20, "name": "draft.txt", "metadata": {"stage": "draft"}}
        )
        assert created.status_code == 201, created.text
        doc_id = created.json()["document"]["id"]
        _error(http.put("/v1/documents/doc_missing", json={"text": "x"}), 404)
        with client(env, ALPHA) as other:
            _error(other.put(f"/v1/documents/{doc_id}", json={"text": "taken over"}), 404)
        replaced = http.put(
            f"/v1/documents/{doc_id}",
            files={"file": ("report.pdf", pdf, "application/pdf")},
            data={"background": "false"},
        )
        assert replaced.status_code == 200, replaced.text
        body = replaced.json()
        assert body["document"]["id"] == doc_id and body["ingest"]["replaced"] is True
        assert body["document"]["name"] == "report.pdf" and body["document"]["metadata"] == {"stage": "draft"}
        shown = http.get(f"/v1/documents/{doc_id}", params={"include_text": "true"}).json()
        assert "first draft" not in shown["text"] and PAGE_FACTS[2] in " ".join(shown["text"].split())
        assert [d["id"] for d in http.get("/v1/documents").json()["data"]].count(doc_id) == 1
        answer = http.post(
            "/v1/query",
            json={
                "question": "When does the ferry to Inish More leave?",
                "document_ids": [doc_id],
                "top_k": 2,
                "max_tokens": 2,
            },
        )
        assert answer.status_code == 200, answer.text
        best = max(answer.json()["citations"], key=lambda c: c["score"])
        assert best["page"] == 2 and best["document_id"] == doc_id
        assert http.delete(f"/v1/documents/{doc_id}").status_code == 200


# -- questions and chat -----------------------------------------------------------------------


def test_query_answers_with_citations_usage_and_timings(env, docs):
    with client(env) as http:
        response = http.post(
            "/v1/query",
            json={
                "question": "When was Gull Point Light first lit?",
                "top_k": 2,
                "strategy": "a3",
                "ratio": 0.15,
                "max_tokens": 8,
            },
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["answer"] and body["strategy"] == "a3" and body["finish_reason"] in ("length", "eos", "stop")
    top = body["citations"][0]
    assert top["document_id"] == docs["lighthouses.md"] and top["chunk_index"] == 0
    assert (
        "Gull Point" in top["text"]
        and top["char_end"] > top["char_start"]
        and top["score"] > body["citations"][1]["score"]
    )
    usage = body["usage"]
    assert usage["cached_tokens"] > usage["computed_tokens"] > 0 and usage["recomputed_tokens"] > 0
    assert (
        usage["cached_tokens"] + usage["computed_tokens"] == usage["prompt_tokens"]
        and 1 <= usage["completion_tokens"] <= 8
    )
    timings = body["timings"]
    assert {"retrieve", "load", "fuse", "ttft", "decode", "queue", "total"} <= set(timings)
    # the prefetch stage retrieves and loads while the request waits: those overlap its queue time
    ahead = max(timings["queue"], timings["retrieve"] + timings["load"])
    assert timings["ttft"] >= ahead + timings["fuse"] - 1e-3


def test_query_with_a_sparse_selector(env, docs):
    pytest.importorskip("ragkv.sparse")
    with client(env) as http:
        response = http.post(
            "/v1/query",
            json={
                "question": "How tall is Stormhead Light?",
                "top_k": 2,
                "max_tokens": 4,
                "selector": "oracle",
                "budget": 0.25,
                "snapkv_capacity": 512,
            },
        )
    assert response.status_code == 200, response.text
    assert response.json()["answer"] and response.json()["usage"]["completion_tokens"] >= 1


def test_query_streams_server_sent_events(env, docs):
    events = []
    with (
        client(env) as http,
        http.stream(
            "POST", "/v1/query", json={"question": "What is Linden Gold?", "top_k": 1, "max_tokens": 8, "stream": True}
        ) as response,
    ):
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    parsed = [json.loads(event) for event in events[:-1]]
    assert parsed[0]["type"] == "retrieval" and parsed[0]["citations"][0]["name"] == "orchard.txt"
    tokens = [event["text"] for event in parsed if event["type"] == "token"]
    assert tokens and parsed[-1]["type"] == "done" and parsed[-1]["answer"] == "".join(tokens).strip()


def test_openai_chat_session_reuses_its_kv(corpus, chat_session, chat_prompt):
    first, chunks = chat_session.first, chat_session.chunks
    assert first.choices[0].message.content and first.choices[0].finish_reason in ("stop", "length")
    corpus_tokens = sum(body["document"]["tokens"] for name, body in corpus.items() if not name.startswith("beta:"))
    assert first.rag["turn"] == 1 and len(first.rag["citations"]) == 3 and first.usage.prompt_tokens > corpus_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    usage = chunks[-1].usage
    assert text and final.session_id == chat_session.id and final.rag["turn"] == 2 and final.rag["new_chunks"] == 0
    # Turn 2 computes only the end of the previous answer and the new message on top of turn 1's KV.
    assert usage.prompt_tokens_details.cached_tokens == usage.cached_tokens >= first.usage.prompt_tokens
    turn = chat_prompt.turn_ids(FOLLOW_UP, first.choices[0].message.content)
    assert 0 < usage.computed_tokens <= len(turn) and usage.prompt_tokens == usage.cached_tokens + usage.computed_tokens
    ttft_1, ttft_2 = first.rag["timings"]["ttft"], final.rag["timings"]["ttft"]
    print(f"\nchat TTFT turn 1 {ttft_1:.3f} s, turn 2 {ttft_2:.3f} s ({ttft_2 / ttft_1:.0%})")


def test_history_resent_without_a_session_id_reuses_the_cached_prefix(env, docs, chat_prompt):
    chat = openai_client(env)
    question = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "How tall is Stormhead Light?"},
    ]
    first = chat.chat.completions.create(model=MODEL, max_tokens=8, messages=question, extra_body={"rag": {"top_k": 2}})
    history = question + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Who built it?"},
    ]
    second = chat.chat.completions.create(model=MODEL, max_tokens=8, messages=history, extra_body={"rag": {"top_k": 2}})
    cached = second.usage.prompt_tokens_details.cached_tokens
    # computed: the new message, plus any chunk the follow-up's retrieval newly fuses in
    turn = chat_prompt.turn_ids("Who built it?", first.choices[0].message.content)
    assert cached >= first.usage.prompt_tokens
    assert second.usage.prompt_tokens - cached - second.usage.document_tokens <= len(turn)
    assert second.rag["turn"] == 2 and second.rag["context_tokens"] >= first.usage.prompt_tokens
    # Another tenant sending the same history finds no context of alpha's.
    beta = openai_client(env, key=BETA).chat.completions.create(model=MODEL, max_tokens=2, messages=history)
    assert beta.rag["context_tokens"] == 0 and first.rag["context_tokens"] == 0


def test_unknown_session_is_404_and_delete_frees_a_session(env):
    chat = openai_client(env)
    with pytest.raises(openai.NotFoundError) as caught:
        chat.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            extra_body={"session_id": "sess_never_made"},
            messages=[{"role": "user", "content": "Hello?"}],
        )
    assert caught.value.body["code"] == "session_not_found"
    made = chat.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi."}], extra_body={"rag": {"enabled": False}}
    )
    with client(env) as http:
        assert http.delete(f"/v1/sessions/{made.session_id}").status_code == 200
        assert _error(http.delete(f"/v1/sessions/{made.session_id}"), 404)["code"] == "session_not_found"
    with pytest.raises(openai.NotFoundError):
        chat.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            extra_body={"session_id": made.session_id},
            messages=[{"role": "user", "content": "Still there?"}],
        )


def test_later_turn_fuses_newly_retrieved_chunks(env, corpus):
    chat = openai_client(env)
    first = chat.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        extra_body={"rag": {"top_k": 1}},
        messages=[{"role": "user", "content": "How tall is Stormhead Light?"}],
    )
    assert [c["name"] for c in first.rag["citations"]] == ["lighthouses.md"]
    second = chat.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        extra_body={"rag": {"top_k": 1}, "session_id": first.session_id},
        messages=[{"role": "user", "content": "How many apple varieties does Linden Hill Orchard grow?"}],
    )
    assert second.rag["turn"] == 2 and second.rag["new_chunks"] == 1
    assert [c["name"] for c in second.rag["citations"]] == ["orchard.txt"]
    assert (
        second.usage.cached_tokens >= first.usage.prompt_tokens
        and second.usage.prompt_tokens > first.usage.prompt_tokens + corpus["orchard.txt"]["document"]["tokens"]
    )


def test_stream_disconnect_cancels_the_work(env, docs):
    def cancelled() -> float:
        metrics = httpx.get(env["server"].url + "/metrics").text
        for line in metrics.splitlines():
            if line.startswith('ragkv_worker_jobs_total{kind="query",outcome="cancelled"}'):
                return float(line.split()[-1])
        return 0.0

    before = cancelled()
    with (
        client(env) as http,
        http.stream(
            "POST",
            "/v1/query",
            json={"question": "Describe the orchard in detail.", "top_k": 1, "max_tokens": 400, "stream": True},
        ) as response,
    ):
        tokens = 0
        for line in response.iter_lines():
            tokens += '"type":"token"' in line
            if tokens == 2:
                break  # leaving the block closes the connection mid-answer
    deadline = time.monotonic() + 15
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled() == before + 1
    health = httpx.get(env["server"].url + "/health").json()
    assert health["worker"]["active"] == 0 and health["worker"]["queued"] == 0


# -- tenants and bad input --------------------------------------------------------------------


def test_tenants_are_isolated(env, corpus, docs, chat_session, chat_prompt):
    alpha_doc, beta_doc = docs["lighthouses.md"], corpus["beta:orchard.txt"]["document"]["id"]
    with client(env, BETA) as http:
        listed = {doc["id"] for doc in http.get("/v1/documents").json()["data"]}
        assert beta_doc in listed and not listed & set(docs.values())
        _error(http.get(f"/v1/documents/{alpha_doc}"), 404)
        _error(http.delete(f"/v1/documents/{alpha_doc}"), 404)
        _error(
            http.post("/v1/query", json={"question": "Gull Point?", "document_ids": [alpha_doc], "max_tokens": 2}), 404
        )
        answer = http.post(
            "/v1/query", json={"question": "When was Gull Point Light first lit?", "max_tokens": 2}
        ).json()
        assert {c["name"] for c in answer["citations"]} == {"orchard.txt"}
    with pytest.raises(openai.NotFoundError):  # alpha's session does not exist for beta
        openai_client(env, key=BETA).chat.completions.create(
            model=MODEL,
            max_tokens=2,
            extra_body={"session_id": chat_session.id},
            messages=[{"role": "user", "content": "What did I ask before?"}],
        )
    beta_chat = openai_client(env, key=BETA).chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "What did I ask before?"}]
    )
    assert beta_chat.rag["turn"] == 1 and {c["name"] for c in beta_chat.rag["citations"]} == {"orchard.txt"}
    with client(env) as http:  # alpha still sees its own documents, and not beta's
        listed = {doc["id"] for doc in http.get("/v1/documents").json()["data"]}
        assert set(docs.values()) <= listed and beta_doc not in listed
    # A tenant with no documents chats with the plain model (nothing retrieved, nothing leaked).
    question = [{"role": "user", "content": FIRST_QUESTION}]
    plain = openai_client(env, key=GAMMA).chat.completions.create(model=MODEL, max_tokens=2, messages=question)
    assert plain.rag["citations"] == [] and plain.rag["strategy"] == "none"
    assert plain.usage.prompt_tokens == len(chat_prompt.encode_messages(question))


def test_bad_inputs_get_clear_4xx(env):
    with client(env) as http:
        assert (
            _error(
                http.post("/v1/query", content=b'{"question": "x",', headers={"content-type": "application/json"}), 400
            )["code"]
            == "malformed_json"
        )
        assert "top_k" in _error(http.post("/v1/query", json={"question": "x", "top_k": 0}), 400)["message"]
        assert (
            "unknown fusion strategy"
            in _error(http.post("/v1/query", json={"question": "x", "strategy": "nope"}), 400)["message"]
        )
        assert "ratio" in _error(http.post("/v1/query", json={"question": "x", "ratio": 2}), 400)["message"]
        assert (
            "max_tokens" in _error(http.post("/v1/query", json={"question": "x", "max_tokens": 10**6}), 400)["message"]
        )
        assert "Extra inputs" in _error(http.post("/v1/query", json={"question": "x", "bogus": 1}), 400)["message"]
        assert (
            "unknown selector"
            in _error(http.post("/v1/query", json={"question": "x", "selector": "magic"}), 400)["message"]
        )
        assert (
            "budget"
            in _error(http.post("/v1/query", json={"question": "x", "selector": "oracle", "budget": 2.5}), 400)[
                "message"
            ]
        )
        _error(http.post("/v1/query", json={"question": "x", "document_ids": ["doc_missing"]}), 404)
        _error(http.get("/v1/documents/doc_missing"), 404)
        _error(http.get("/v1/documents/bad id"), 400)
        _error(http.get("/v1/jobs/job_missing"), 404)
        _error(http.get("/v1/no/such/route"), 404)
        assert _error(http.post("/v1/query", json={"question": "x" * 100_000}), 413)["code"] == "body_too_large"
        _error(http.post("/v1/documents", json={"text": "a" * (1 << 20) + "b"}), 413)
        assert (
            "text: Value error, must not be empty"
            in _error(http.post("/v1/documents", json={"text": "   "}), 400)["message"]
        )
        assert (
            _error(http.post("/v1/documents", files={"file": ("x.txt", b"\x00\x01binary", "text/plain")}), 415)["code"]
            == "binary"
        )
        assert (
            _error(http.post("/v1/documents", files={"file": ("x.odt", b"PK", "application/zip")}), 415)["code"]
            == "unsupported_type"
        )
        assert (
            _error(http.post("/v1/documents", files={"file": ("x.pdf", b"%PDF", "application/pdf")}), 422)["code"]
            == "unreadable"
        )
        _error(http.post("/v1/documents", content=b"plain", headers={"content-type": "text/plain"}), 415)
        _error(http.post("/v1/documents", json={"text": "hello", "metadata": [1]}), 400)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert (
            _error(http.post("/v1/chat/completions", json={**chat, "model": "gpt-4"}), 404)["code"] == "model_not_found"
        )
        _error(http.post("/v1/chat/completions", json={**chat, "messages": []}), 400)
        _error(http.post("/v1/chat/completions", json={**chat, "n": 2}), 400)
        _error(http.post("/v1/chat/completions", json={**chat, "temperature": -1}), 400)
        _error(http.post("/v1/chat/completions", json={**chat, "session_id": "no spaces allowed"}), 400)
        _error(http.post("/v1/chat/completions", json={**chat, "rag": {"top_k": 999}}), 400)
        _error(http.post("/v1/chat/completions", json={**chat, "rag": {"selector": "oracle"}}), 400)
    with client(env, key="wrong-key-123") as http:
        assert _error(http.get("/v1/documents"), 401)["code"] == "invalid_api_key"
    with client(env, key=None) as http:
        assert _error(http.post("/v1/query", json={"question": "x"}), 401)["code"] == "missing_api_key"
    with pytest.raises(openai.NotFoundError):
        openai_client(env).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


# -- Redis: a second replica, then Redis lost -------------------------------------------------


def test_second_replica_shares_chunks_and_sessions(env, docs, chat_session):
    args = _serve_args(env["root"], "b", env["redis"].url, env["keys"])
    with ServerProcess(args, log_path=env["root"] / "b.log") as replica:
        with httpx.Client(base_url=replica.url, headers={"Authorization": f"Bearer {ALPHA}"}, timeout=180) as http:
            text = (CORPUS / "lighthouses.md").read_text()
            body = http.post("/v1/documents", json={"text": text, "name": "lighthouses.md"}).json()
            assert body["ingest"]["computed_chunks"] == 0, body  # replica A's chunk KV, read from Redis
        length = chat_session.chunks[-1].usage.prompt_tokens
        turn = openai_client(env, url=replica.url).chat.completions.create(
            model=MODEL,
            max_tokens=4,
            extra_body={"session_id": chat_session.id, "rag": {"enabled": False}},
            messages=[{"role": "user", "content": "Thank you. And where is her log kept?"}],
        )
        assert turn.rag["turn"] == 3 and turn.usage.cached_tokens >= length  # replica A's session, from Redis


def test_metrics_exposes_serving_figures(env, docs):
    with client(env) as http:  # a question over stored chunks: lookups hit, tokens reused and recomputed
        answer = http.post("/v1/query", json={"question": FIRST_QUESTION, "top_k": 2, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
    metrics = httpx.get(env["server"].url + "/metrics").text
    for name in (
        "ragkv_http_requests_total",
        "ragkv_http_request_seconds_bucket",
        "ragkv_ttft_seconds_bucket",
        'ragkv_chunk_lookups_total{result="hit"}',
        'ragkv_tokens_total{kind="reused"}',
        'ragkv_tokens_total{kind="recomputed"}',
        "ragkv_store_entries",
        "ragkv_store_bytes",
        'ragkv_redis_up{role="chunks"} 1.0',
        "ragkv_degraded 0.0",
        "ragkv_worker_queue_depth",
    ):
        assert name in metrics, name


def test_redis_loss_degrades_but_keeps_answering(tmp_path, killable_redis):
    """A server of its own over a Redis of its own, which the test kills."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({ALPHA: "alpha"}))
    with ServerProcess(_serve_args(tmp_path, "a", killable_redis.url, keys), log_path=tmp_path / "a.log") as server:
        env = {"server": server}
        with client(env) as http:
            text = (CORPUS / "lighthouses.md").read_text()
            assert http.post("/v1/documents", json={"text": text, "name": "lighthouses.md"}).status_code == 201
        killable_redis.stop()
        with client(env) as http:
            health = http.get("/health").json()
            assert health["status"] == "degraded" and health["store"]["redis_up"] is False
            assert health["sessions"]["redis_up"] is False and health["problems"]
            answer = http.post(
                "/v1/query", json={"question": "What colour is Kestrel Bay Light?", "top_k": 1, "max_tokens": 4}
            )
            assert answer.status_code == 200 and answer.json()["answer"], answer.text
            metrics = http.get("/metrics").text
            assert "ragkv_degraded 1.0" in metrics and 'ragkv_redis_up{role="chunks"} 0.0' in metrics
        chat = openai_client(env)
        fresh = chat.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            extra_body={"rag": {"top_k": 1}},
            messages=[{"role": "user", "content": "When was the observatory founded?"}],
        )
        follow = chat.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            extra_body={"session_id": fresh.session_id, "rag": {"enabled": False}},
            messages=[{"role": "user", "content": "Who founded it?"}],
        )
        assert follow.rag["turn"] == 2 and follow.usage.cached_tokens >= fresh.usage.prompt_tokens  # memory fallback


def test_a_store_that_cannot_take_the_write_answers_503(tmp_path):
    args = [
        "--data-dir",
        str(tmp_path / "data"),
        "--store",
        "redis://127.0.0.1:1/0",
        "--log-level",
        "warning",
        "--background-ingest-bytes",
        "100000",
    ]
    with (
        ServerProcess(args, log_path=tmp_path / "serve.log") as server,
        httpx.Client(base_url=server.url, timeout=180) as http,
    ):
        text = (CORPUS / "orchard.txt").read_text()
        error = _error(http.post("/v1/documents", json={"text": text, "name": "orchard.txt"}), 503)
        assert error["code"] == "store_unavailable" and "nothing was ingested" in error["message"]
        assert http.get("/v1/documents").json()["data"] == []
