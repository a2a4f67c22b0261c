"""Every kind of request (a RAG query, a chat turn, a plain completion) runs through the one
scheduler: they decode side by side in the same batched step, each giving the tokens it
gives alone, and a stop string ends each of them the same way (one detokenizer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ragkv.app.chat.contexts import ContextCache
from ragkv.app.chat.turn import ChatInfo, ChatTurn, ChatTurns
from ragkv.app.completion import PassageRequest, completion_request, prompt_ids
from ragkv.app.generate import CollectingSink, run_alone
from ragkv.app.passages import PromptPassages
from ragkv.app.query import QueryInfo, query_request
from ragkv.app.rag import QueryConfig, RagPipeline
from ragkv.app.request import FinishReason
from ragkv.app.scheduler import Scheduler, SchedulerConfig
from ragkv.app.server.prefetch import Prefetcher
from ragkv.engine.generation import GenerationConfig
from ragkv.errors import InputError
from ragkv.fusion import FusionConfig
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import LMDBStore
from ragkv.store.write_behind import WriteBehindStore

pytestmark = pytest.mark.model

TEXT = "Gull Point Light was first lit on 3 March 1851 and burned whale oil until 1890. " * 4
QUESTION = "When was Gull Point Light first lit?"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The lighthouse keeper climbed the stairs and"


@pytest.fixture(scope="module")
def rag(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    env = LMDBEnvironment(root / "db")
    store = LMDBStore(root / "chunks")
    embedder = Embedder()
    ingestor = Ingestor(
        engine,
        store,
        LMDBDocumentRegistry(env),
        embedder,
        IngestJournal(env),
        IngestConfig(chunk_tokens=64, show_progress=False),
    )
    ingestor.ingest_text(TEXT, "gull.txt")
    yield RagPipeline(engine, store, ingestor.registry, embedder)
    store.close()
    env.close()


def _chat_turns(engine) -> ChatTurns:
    return ChatTurns(SimpleNamespace(engine=engine), ContextCache(1 << 30, 1 << 30, 600))


def _requests(engine, rag, generation: GenerationConfig, turns: ChatTurns) -> dict:
    config = QueryConfig(top_k=2, generation=generation)
    return {
        "query": query_request(rag, QUESTION, "default", config),
        "chat": turns.request(ChatTurn("default", MESSAGES, None, False, config)),
        "completion": completion_request(engine, prompt_ids(engine, PROMPT, generation), generation),
    }


def test_a_query_a_chat_turn_and_a_completion_decode_in_the_same_step(engine, rag):
    generation = GenerationConfig(max_new_tokens=12)
    alone = {
        kind: run_alone(engine, request)
        for kind, request in _requests(engine, rag, generation, _chat_turns(engine)).items()
    }

    scheduler = Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids, SchedulerConfig(max_running=4))
    requests = _requests(engine, rag, generation, _chat_turns(engine))
    sinks = {kind: CollectingSink() for kind in requests}
    for kind, request in requests.items():
        request.sink = sinks[kind]
        scheduler.add(request)
    together = []
    while scheduler.has_work:
        scheduler.step()
        together.append({request.kind for request in scheduler.running})
    assert {"query", "chat", "completion"} in together  # one batched decode step held all three kinds

    for kind, sink in sinks.items():
        assert sink.error is None, kind
        done = sink.completion
        assert done.token_ids == alone[kind].token_ids and done.text == alone[kind].text, kind
        assert done.finish_reason == alone[kind].finish_reason
    assert isinstance(sinks["query"].completion.info, QueryInfo) and sinks["query"].completion.citations
    assert isinstance(sinks["chat"].completion.info, ChatInfo) and sinks["chat"].completion.info.turn == 1
    assert sinks["completion"].completion.usage.prompt_tokens == len(prompt_ids(engine, PROMPT, generation))
    # a completion keeps its text as generated; answers are stripped
    assert sinks["completion"].completion.text == "".join(sinks["completion"].pieces)


def test_a_stop_string_ends_every_kind_the_same_way(engine, rag):
    free = GenerationConfig(max_new_tokens=16)
    unstopped = {
        kind: run_alone(engine, request) for kind, request in _requests(engine, rag, free, _chat_turns(engine)).items()
    }
    for kind, done in unstopped.items():
        words = done.text.split()
        assert len(words) >= 3, (kind, done.text)
        stop = words[2]
        generation = GenerationConfig(max_new_tokens=16, stop=(stop,))
        sink = CollectingSink()
        stopped = run_alone(engine, _requests(engine, rag, generation, _chat_turns(engine))[kind], sink)
        assert stopped.finish_reason is FinishReason.STOP, kind
        cut = done.text[: done.text.index(stop)]
        assert stopped.text == (cut if kind == "completion" else cut.strip()), kind
        assert "".join(sink.pieces).strip() == stopped.text.strip() and stop not in "".join(sink.pieces), kind

    # A completion of the chat template's ids is the chat turn's answer, stop string and all.
    chat_ids = engine.prompt.encode_messages(MESSAGES)
    stop = unstopped["chat"].text.split()[2]
    generation = GenerationConfig(max_new_tokens=16, stop=(stop,))
    turn = run_alone(engine, _requests(engine, rag, generation, _chat_turns(engine))["chat"])
    completion = run_alone(engine, completion_request(engine, chat_ids, generation))
    assert completion.text.strip() == turn.text and completion.token_ids == turn.token_ids


def test_a_prompt_is_checked_before_it_is_queued(engine):
    generation = GenerationConfig(max_new_tokens=4)
    for prompt, reason in (
        ([], "empty_prompt"),
        ([engine.spec.vocab_size], "bad_token_id"),
        ([1] * engine.spec.rope.max_position_embeddings, "context_length_exceeded"),
    ):
        with pytest.raises(InputError) as raised:
            prompt_ids(engine, prompt, generation)
        assert raised.value.reason == reason


def test_every_kind_refuses_a_prompt_and_answer_past_the_context_the_same_way(engine, rag):
    limit = engine.spec.rope.max_position_embeddings
    generation = GenerationConfig(max_new_tokens=limit)
    refusals = []
    for kind in ("query", "chat"):
        with pytest.raises(InputError) as raised:
            run_alone(engine, _requests(engine, rag, generation, _chat_turns(engine))[kind])
        refusals.append(raised.value)
    with pytest.raises(InputError) as raised:
        prompt_ids(engine, PROMPT, generation)
    refusals.append(raised.value)
    for error in refusals:
        assert error.reason == "context_length_exceeded"
        assert f"and max_tokens is {limit}:" in str(error) and f"above the model's context of {limit};" in str(error)


def test_inputs_fetched_ahead_give_the_answers_of_the_inline_path(engine, rag):
    """The prefetch stage runs each kind's fetch (retrieval, store reads, span look-ups) on
    its own thread; the answers are those of the one-request path, where it runs inline."""
    generation = GenerationConfig(max_new_tokens=12)
    passages = PassageRequest(PromptPassages(engine, WriteBehindStore(rag.store)), "default", FusionConfig())
    pasted = prompt_ids(engine, f"Context:\n\n{TEXT.strip()}\n\n{QUESTION}", generation)

    def requests() -> dict:
        config = QueryConfig(top_k=2, generation=generation)
        turns = ChatTurns(rag, ContextCache(1 << 30, 1 << 30, 600))
        rag_turn = ChatTurn("default", [{"role": "user", "content": QUESTION}], None, True, config)
        return {
            "query": query_request(rag, QUESTION, "default", config),
            "chat": turns.request(rag_turn),
            "completion": completion_request(engine, prompt_ids(engine, PROMPT, generation), generation),
            "passages": completion_request(engine, pasted, generation, passages=passages),
        }

    run_alone(engine, requests()["passages"])  # stores the pasted passage: both runs below reuse it
    alone = {kind: run_alone(engine, request) for kind, request in requests().items()}
    assert alone["passages"].usage.document_tokens > 0  # the pasted passage was found

    prefetch = Prefetcher(64 << 20)
    scheduler = Scheduler(
        engine.model, engine.tokenizer, engine.eos_token_ids, SchedulerConfig(max_running=4), prefetch=prefetch
    )
    ahead = requests()
    sinks = {kind: CollectingSink() for kind in ahead}
    try:
        for kind, request in ahead.items():
            request.sink = sinks[kind]
            scheduler.add(request)
        while scheduler.has_work:
            scheduler.step()
    finally:
        prefetch.close()
        passages.passages.store.close()
    for kind, sink in sinks.items():
        assert sink.error is None, kind
        assert sink.completion.token_ids == alone[kind].token_ids and sink.completion.text == alone[kind].text, kind
        assert sink.completion.citations == alone[kind].citations, kind
    assert prefetch.held_bytes == 0
