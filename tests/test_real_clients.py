"""Real RAG clients against a live `ragkv serve` (the shared server, a tenant of its own),
each sending its prompt exactly as it does: LangChain's stuff chain over documents its
RecursiveCharacterTextSplitter cut (then cut again with another size, so every chunk edge
moves), LangChain's hub prompt rlm/rag-prompt (the question first), LlamaIndex's default
query engine over `OpenAILike` (its SentenceSplitter, its CHAT_TEXT_QA_PROMPT, metadata
lines per node), and Open WebUI's RAG template with one-line <source> tags. The second
request of each reuses the rows the first stored: its cached share is read from the usage
the server answers, and set against the same request with passage reuse switched off."""

from __future__ import annotations

import random
from types import SimpleNamespace

import openai
import pytest

from ragkv.bench.prompt_shapes import SHAPES, Passage

pytestmark = pytest.mark.model

TOWNS = ["Kestrel Bay", "Orlen Ford", "Vasse Hill", "Tamber Cross", "Hollin Mere", "Dunsford"]
TRADES = ["salt", "wool", "slate", "cider", "linen", "timber", "copper", "herring"]


def _document(number: int) -> str:
    rng = random.Random(number)
    town = TOWNS[number % len(TOWNS)]
    lines = []
    for _ in range(4):
        sentences = [
            f"In {1700 + rng.randrange(300)} the {rng.choice(TRADES)} merchants of {town} paid for a "
            f"{rng.choice(['bridge', 'chapel', 'warehouse', 'school', 'mill', 'quay'])} beside the "
            f"{rng.choice(['river', 'market', 'harbour', 'green', 'castle'])}, and {rng.randrange(2, 90)} "
            f"families moved there within {rng.randrange(2, 30)} years."
            for _ in range(4)
        ]
        lines.append(" ".join(sentences))
    return f"The history of {town}, part {number}.\n\n" + "\n\n".join(lines)


DOCUMENTS = [_document(n) for n in range(6)]


@pytest.fixture(scope="module")
def server(shared_server) -> SimpleNamespace:
    return SimpleNamespace(url=shared_server.url, key=shared_server.key["real-clients"])


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=600.0)


def _cached_share(usage: dict) -> float:
    return usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]


def _text(messages: list[dict]) -> str:
    return "\n".join(m["content"] for m in messages)


def _common_prefix_share(before: list[dict], after: list[dict]) -> float:
    """The share of `after` (in characters) that a prefix cache alone could serve."""
    one, two = _text(before), _text(after)
    common = next((i for i, (a, b) in enumerate(zip(one, two)) if a != b), min(len(one), len(two)))
    return common / len(two)


def test_langchain_stuff_chain_over_a_splitter_that_cuts_differently(server, client):
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    llm = ChatOpenAI(
        model="ragkv", base_url=server.url + "/v1", api_key=server.key, max_tokens=3, temperature=0, max_retries=0
    )
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer the user's question using only the context below.\n\n{context}"), ("human", "{input}")]
    )
    documents = [Document(page_content=text) for text in DOCUMENTS[:4]]

    def ask(chunk_size: int, question: str, seed: int):
        chunks = RecursiveCharacterTextSplitter(chunk_size=chunk_size, chunk_overlap=200).split_documents(documents)
        random.Random(seed).shuffle(chunks)  # a retriever's order
        # create_stuff_documents_chain: "{page_content}" per document, joined by "\n\n"
        context = "\n\n".join(chunk.page_content for chunk in chunks)
        message = (prompt | llm).invoke({"context": context, "input": question})
        rendered = prompt.invoke({"context": context, "input": question}).messages
        return message.response_metadata["token_usage"], [{"content": m.content} for m in rendered]

    _, first = ask(1000, "Which town paid for a bridge?", 0)
    usage, second = ask(800, "How many families moved to Orlen Ford?", 1)
    assert _cached_share(usage) > 0.7 and _cached_share(usage) > _common_prefix_share(first, second) + 0.6


def test_langchain_hub_prompt_puts_the_question_first(server, client):
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    # rlm/rag-prompt as the hub serves it (one human message)
    hub = ChatPromptTemplate.from_messages(
        [
            (
                "human",
                "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
                "to answer the question. If you don't know the answer, just say that you don't know. Use three "
                "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:",
            )
        ]
    )
    llm = ChatOpenAI(
        model="ragkv", base_url=server.url + "/v1", api_key=server.key, max_tokens=3, temperature=0, max_retries=0
    )
    values = [
        {"question": "What did the slate merchants build?", "context": "\n\n".join(DOCUMENTS[2:5])},
        {"question": "Name a chapel.", "context": "\n\n".join(DOCUMENTS[i] for i in (4, 2, 3))},
    ]
    (hub | llm).invoke(values[0])
    message = (hub | llm).invoke(values[1])
    # the question opens the prompt: a prefix cache serves only the instructions
    first, second = ([{"content": m.content} for m in hub.invoke(v).messages] for v in values)
    share = _cached_share(message.response_metadata["token_usage"])
    assert share > 0.7 and share > _common_prefix_share(first, second) + 0.6


def test_llamaindex_default_query_engine_over_openai_like(server, client):
    from llama_index.core import Document, MockEmbedding, Settings, VectorStoreIndex
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.llms.openai_like import OpenAILike

    class Calls(BaseEventHandler):
        """Each chat call LlamaIndex made: the messages it sent and the usage answered."""

        calls: list = []

        def handle(self, event, **kwargs):
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                messages = [{"role": m.role.value, "content": m.content} for m in event.messages]
                self.calls.append((messages, event.response.raw.usage))

    calls = Calls()
    get_dispatcher().add_event_handler(calls)
    # LlamaIndex counts tokens with tiktoken, whose encoding files it would download: a
    # whitespace count stands in. No embedding model is reachable through LlamaIndex here
    # (its HuggingFace and OpenAI embedders are other packages): MockEmbedding ranks every
    # node alike, and the query engine retrieves all of them.
    Settings.tokenizer = str.split
    llm = OpenAILike(
        model="ragkv",
        api_base=server.url + "/v1",
        api_key=server.key,
        is_chat_model=True,
        context_window=8192,
        max_tokens=3,
        temperature=0,
        max_retries=0,
        timeout=600,
    )
    # SimpleDirectoryReader's metadata: only file_path reaches the LLM
    documents = [
        Document(
            text=text,
            metadata={"file_path": f"/data/town_{n}.txt", "file_name": f"town_{n}.txt"},
            excluded_llm_metadata_keys=["file_name"],
        )
        for n, text in enumerate(DOCUMENTS[:4])
    ]

    def ask(chunk_size: int, question: str) -> None:
        index = VectorStoreIndex.from_documents(
            documents,
            transformations=[SentenceSplitter(chunk_size=chunk_size, chunk_overlap=40)],
            embed_model=MockEmbedding(embed_dim=8),
        )
        answer = index.as_query_engine(llm=llm, similarity_top_k=100).query(question)
        assert answer.source_nodes and answer.response is not None

    ask(220, "Which town built a mill?")
    ask(160, "Which trade paid for the quay?")  # other chunk edges, other order
    first, _ = calls.calls[-2]
    messages, usage = calls.calls[-1]
    assert (
        "file_path: /data/town_" in messages[-1]["content"]
        and "Context information is below." in messages[-1]["content"]
    )
    share = usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens
    assert share > 0.6 and share > _common_prefix_share(first, messages) + 0.5


def test_open_webui_prompt_as_it_sends_it(client):
    shape = SHAPES["open_webui"]

    def sources(order):
        return [Passage(DOCUMENTS[i], f"town_{i}.pdf", n) for n, i in enumerate(order, 1)]

    first = shape.messages(sources([0, 1, 2, 3, 4]), "Which town paid for a school?")
    client.chat.completions.create(model="ragkv", messages=first, max_tokens=1)
    messages = shape.messages(sources([4, 2, 5, 0]), "When did the wool merchants build a bridge?")
    warm = client.chat.completions.create(model="ragkv", messages=messages, max_tokens=3)
    reusable = sum(len(DOCUMENTS[i]) for i in (4, 2, 0)) / sum(len(m["content"]) for m in messages)
    share = warm.usage.prompt_tokens_details.cached_tokens / warm.usage.prompt_tokens
    assert share > 0.8 * reusable and share > _common_prefix_share(first, messages) + 0.4
    assert warm.choices[0].message.content is not None
