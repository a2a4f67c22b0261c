"""Passages pasted by the client, against a live `ragkv serve` with no documents of its tenant ingested:
the `openai` client on chat, completions and responses, LangChain's stuff-documents
prompt over `ChatOpenAI`, the per-request switch, the usage and /metrics figures, and bad
input answered as before.

The tests share one server and its store, yet each passes alone and in any order: a test
pastes the passages it reuses itself, set in a town of its own, so its first paste is cold
whatever ran before it, and it reads the server-wide counters as differences."""

from __future__ import annotations

import re
from types import SimpleNamespace

import httpx
import openai
import pytest

pytestmark = pytest.mark.model

PLACES = (  # name, founded, by whom, what was rebuilt, when
    ("Gull Point Light", 1851, "the harbour board", "lantern room", 1890),
    ("Linden Hill Orchard", 1902, "the Maas family", "cider house", 1984),
    ("Hallerberg Observatory", 1936, "the university", "main dome", 1962),
    ("Marrow Creek Ferry", 1822, "two cattle dealers", "landing stage", 1907),
    ("Saltmarsh Mill", 1788, "a grain cooperative", "water wheel", 1931),
    ("Brisk Hollow School", 1874, "the parish", "bell tower", 1950),
)


def passages(town: str) -> list[str]:
    """Six passages, one per place of PLACES, set in `town`. The town is named every few
    tokens, so two towns' passages share no stretch as long as an anchor's window (`AnchorConfig`):
    nothing one test pasted is reused by another's prompt, not even in part."""
    return [
        f"{name} was founded at {town} in {year} by {who} of {town}; its {thing} was rebuilt by {town} "
        f"masons in {rebuilt} after a {town} fire, and the {town} archive keeps the plans, {town} letters "
        f"and accounts of the {town} works. " * 4
        for name, year, who, thing, rebuilt in PLACES
    ]


INGESTED = (
    "Redstone Quarry was opened in 1868 by a railway contractor; its granite paved the harbour road and "
    "the cathedral steps, and the flooded pit became a swimming lake when cutting stopped in 1961. " * 4
)


def stuffed(town: str, order: list[int], question: str) -> list[dict]:
    """A chat with `town`'s passages in `order`. The town opens the prompt too (within its
    first context block), so no other test's chat left a context this one's prefix finds."""
    documents = "\n\n".join(passages(town)[i] for i in order)
    return [
        {"role": "system", "content": f"Answer the question using the documents about {town}."},
        {"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: {question}"},
    ]


@pytest.fixture(scope="module")
def server(shared_server) -> SimpleNamespace:
    """The shared server (tests/conftest.py), as this module's tenant: no document of its
    own but the one a test ingests and deletes, and no passage any other tenant pasted."""
    return SimpleNamespace(url=shared_server.url, key=shared_server.key["prompt-spans"])


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=600.0)


def counter(server, name: str) -> float:
    """A server-wide counter of /metrics (other tenants' requests count too: read differences)."""
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    return float(re.search(rf"^{re.escape(name)}(?:\{{.*\}})? (\S+)$", metrics, re.M).group(1))


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def paste(client, town: str, order: list[int]) -> None:
    """Pastes `town`'s passages in `order` into a chat, the first time: nothing is reused yet,
    so what a later prompt reuses is what this paste stored."""
    first = client.chat.completions.create(model="ragkv", messages=stuffed(town, order, "Name one."), max_tokens=1)
    assert cached(first.usage) == 0


def test_chat_passages_in_a_new_order_come_from_the_store(client, server):
    hits, misses = counter(server, "ragkv_prompt_span_hits_total"), counter(server, "ragkv_prompt_span_misses_total")
    prefix_hits = counter(server, "vllm:prefix_cache_hits_total")
    cold = client.chat.completions.create(
        model="ragkv", messages=stuffed("Ashby", [0, 1, 2, 3, 4, 5], "When was Gull Point Light founded?"), max_tokens=4
    )
    assert cold.usage.prompt_tokens > 1000 and cached(cold.usage) == 0
    warm = client.chat.completions.create(
        model="ragkv", messages=stuffed("Ashby", [5, 3, 1, 0, 4, 2], "Who founded the orchard?"), max_tokens=4
    )
    assert warm.choices[0].message.content
    # the passages' rows less the probe's recomputed tenth: most of the prompt
    assert cached(warm.usage) > 0.75 * warm.usage.prompt_tokens
    off = client.chat.completions.create(
        model="ragkv",
        messages=stuffed("Ashby", [2, 4, 0, 5, 1, 3], "Who founded the orchard?"),
        max_tokens=4,
        extra_body={"prompt_spans": False},
    )
    assert cached(off.usage) < 0.1 * off.usage.prompt_tokens  # the template's opening at most
    new_hits = counter(server, "ragkv_prompt_span_hits_total") - hits
    new_misses = counter(server, "ragkv_prompt_span_misses_total") - misses
    assert (new_hits, new_misses) == (len(PLACES), len(PLACES))
    assert counter(server, "vllm:prefix_cache_hits_total") - prefix_hits >= cached(warm.usage)


def test_completions_and_responses_reuse_the_same_passages(client):
    pasted = passages("Brill")
    paste(client, "Brill", [0, 1, 2])
    prompt = "Context:\n\n" + "\n\n".join(pasted[i] for i in (2, 0, 1)) + "\n\nQ: Which was founded first?\nA:"
    completion = client.completions.create(model="ragkv", prompt=prompt, max_tokens=2)
    assert cached(completion.usage) > 0.75 * completion.usage.prompt_tokens
    response = client.responses.create(
        model="ragkv",
        instructions="Answer the question using the documents given.",
        input="Documents:\n" + "\n\n".join(pasted[i] for i in (1, 2, 0)) + "\n\nQuestion: Which is oldest?",
        max_output_tokens=2,
    )
    assert response.usage.input_tokens_details.cached_tokens > 0.75 * response.usage.input_tokens


def test_langchain_stuff_documents_prompt(server):
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer using only this context:\n\n{context}"), ("human", "{question}")]
    )
    llm = ChatOpenAI(
        model="ragkv", base_url=server.url + "/v1", api_key=server.key, max_tokens=3, temperature=0, max_retries=0
    )

    pasted = passages("Corfe")

    def ask(order: list[int], question: str) -> dict:
        # what LangChain's stuff-documents chain does: page contents joined by a blank line
        context = "\n\n".join(Document(page_content=pasted[i]).page_content for i in order)
        return (prompt | llm).invoke({"context": context, "question": question}).response_metadata["token_usage"]

    first = ask([3, 4, 5], "Which mill is mentioned?")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0  # what the next prompt reuses, this one stored
    usage = ask([5, 3, 4], "When was the school founded?")
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0.75 * usage["prompt_tokens"]
    assert (prompt | llm | StrOutputParser()).invoke(
        {"context": "\n\n".join(pasted[i] for i in (4, 5, 3)), "question": "Hi"}
    )


def test_bad_input_is_answered_as_before(client):
    too_long = "\n\n".join(passages("Dunmore") * 40)  # far over the model's context
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="ragkv", messages=[{"role": "user", "content": too_long}], max_tokens=2)
    assert "context" in str(error.value)


def test_a_pasted_chunk_of_an_ingested_document_is_found_in_the_store(client, server):
    passage = INGESTED.strip()
    headers = {"Authorization": f"Bearer {server.key}"}
    hits = counter(server, "ragkv_prompt_span_hits_total")
    response = httpx.post(
        server.url + "/v1/documents", json={"text": passage, "name": "quarry.txt"}, headers=headers, timeout=600
    )
    assert response.status_code == 201, response.text
    document = response.json()["document"]
    try:
        assert document["chunks"] == 1  # one chunk: its tokens are the passage's
        messages = [{"role": "user", "content": f"Documents:\n{passage}\n\nQuestion: Who opened the quarry?"}]
        pasted = client.chat.completions.create(
            model="ragkv",
            messages=messages,
            max_tokens=2,
            extra_body={"rag": {"enabled": False}},
        )
        # never pasted before: its rows come from the chunk ingestion stored, less what the probe
        # recomputed (all but its first rows: a short passage is under the probe's min_rows), and
        # any rows of the template's opening an earlier anonymous chat of the tenant left cached
        usage = pasted.usage.model_extra
        assert cached(pasted.usage) >= usage["document_tokens"] - usage["recomputed_tokens"] > 0
        assert counter(server, "ragkv_prompt_span_hits_total") - hits >= 1
    finally:
        # the other tests' chats retrieve from the tenant's documents and expect none
        deleted = httpx.delete(f"{server.url}/v1/documents/{document['id']}", headers=headers, timeout=600)
        deleted.raise_for_status()
