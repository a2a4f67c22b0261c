"""Fidelity on live traffic (ragkv.app.live_fidelity): a sampled fused request's first token is
compared with a full prefill of its prompt when the scheduler is idle, exported as
ragkv_fusion_first_token_kl; a request that arrives meanwhile is admitted at the next step."""

from __future__ import annotations

import os
import time

import pytest
import torch
from fusion_cases import TEXTS
from tiny_models import make_tiny_model

from ragkv.api.config import ServeConfig
from ragkv.api.metrics import Metrics
from ragkv.app.chat.contexts import ContextCache
from ragkv.app.chat.turn import ChatTurn, ChatTurns
from ragkv.app.generate import CollectingSink
from ragkv.app.live_fidelity import FidelitySample, LiveFidelity, LiveFidelityConfig
from ragkv.app.query import fused_prompt_ids, query_request
from ragkv.app.rag import QueryConfig, RagPipeline
from ragkv.app.request import Phase, Prepared, Request
from ragkv.app.scheduler import Scheduler
from ragkv.app.server.worker import ModelWorker
from ragkv.app.usage import TokenUsage
from ragkv.cli.main import main
from ragkv.engine import Engine, EngineConfig
from ragkv.engine.chunked_prefill import ChunkedPrefill
from ragkv.engine.generation import GenerationConfig
from ragkv.fusion import Full, FusionConfig, FusionInput, LoadedChunk, Probe
from ragkv.fusion.fidelity import next_token_kl
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import LMDBStore

QUESTION = "When was Gull Point Light first lit?"
PIECE = 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama-live-fidelity"), tokenizer=True)
    previous = os.environ.get("RAGKV_CACHE")
    os.environ["RAGKV_CACHE"] = str(tmp_path_factory.mktemp("ragkv-cache"))  # weight digests stay out of ~/.cache
    try:
        # float32 KV: a piecewise prefill equals the whole one to float rounding only then (a
        # 16-bit cache is attended in bf16 on CPUs with bf16 units, where the two differ)
        yield Engine(
            EngineConfig(model=str(folder), weights="float32", prefill_weights="float32", kv_cache_dtype="float32")
        )
    finally:
        if previous is None:
            os.environ.pop("RAGKV_CACHE", None)
        else:
            os.environ["RAGKV_CACHE"] = previous


def _fusion_input(engine) -> FusionInput:
    chunks = []
    for text in TEXTS:
        ids = engine.tokenize(text)
        keys, values = engine.model.chunk_kv(torch.tensor(ids), engine.chunk_prefix_cache())
        chunks.append(LoadedChunk(ids, keys, values))
    segments = engine.prompt.rag_segments(QUESTION)
    return FusionInput(segments.prefix_ids, chunks, segments.question_ids, len(engine.chunk_prefix_ids))


def _fused_request(engine, strategy, fused: list, max_new_tokens: int = 4) -> Request:
    """A request prepared as a query is (a fusion of stored chunk KV); `fused` receives its
    fusion result."""

    def prepare(request: Request) -> Prepared:
        fusion = strategy.fuse(engine.model, _fusion_input(engine), engine.chunk_prefix_cache(), max_new_tokens)
        fused.append(fusion)
        usage = TokenUsage.of_fusion(fusion)
        return Prepared(fusion.cache, fusion.logits, usage, strategy.name, fused_prompt_ids=fused_prompt_ids(fusion))

    return Request("query", prepare, GenerationConfig(max_new_tokens=max_new_tokens), CollectingSink())


def _prefill_request(engine, max_new_tokens: int = 4) -> Request:
    def prepare(request: Request) -> Prepared:
        ids = engine.prompt.encode_messages([{"role": "user", "content": "Name three colours."}])
        cache, logits = engine.prefill(ids, max_new_tokens)
        return Prepared(cache, logits, TokenUsage(prompt_tokens=len(ids)), "none")

    return Request("completion", prepare, GenerationConfig(max_new_tokens=max_new_tokens), CollectingSink())


def _scheduler(engine, rate: float, metrics: Metrics | None = None, **options) -> Scheduler:
    metrics = metrics if metrics is not None else Metrics()
    fidelity = LiveFidelity(
        LiveFidelityConfig(rate=rate, seed=0, **options),
        on_measured=metrics.record_fidelity,
        on_dropped=metrics.fidelity_dropped.inc,
    )
    return Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids, fidelity=fidelity)


def _reference_kl(engine, fusion) -> float:
    """KL(full || fused) of the first token, the full prefill run in one pass."""
    _, full_logits = engine.prefill(fusion.layout.token_ids.tolist())
    return next_token_kl(full_logits, fusion.logits)


def _kl_samples(metrics: Metrics, strategy: str) -> tuple[float | None, float | None]:
    labels = {"strategy": strategy}
    registry = metrics.registry
    return (
        registry.get_sample_value("ragkv_fusion_first_token_kl_count", labels),
        registry.get_sample_value("ragkv_fusion_first_token_kl_sum", labels),
    )


@pytest.mark.model
def test_a_sampled_fused_request_is_measured_when_idle_against_a_full_prefill(engine):
    metrics = Metrics()
    scheduler = _scheduler(engine, 1.0, metrics, piece_tokens=PIECE)
    fused: list = []
    request = _fused_request(engine, Probe(ratio=0.1), fused)
    scheduler.add(request)
    scheduler.run_until_done()  # the request alone: nothing is measured while it runs
    assert request.sink.completion is not None and request.sink.error is None
    assert _kl_samples(metrics, "probe") == (None, None)
    assert scheduler.has_idle_work and not scheduler.has_work
    steps = 0
    while scheduler.has_idle_work:
        scheduler.step()
        steps += 1
    prompt = fused[0].layout.length
    assert steps == -(-prompt // PIECE)  # one bounded piece per idle step
    count, total = _kl_samples(metrics, "probe")
    expected = _reference_kl(engine, fused[0])
    assert expected > 1e-6  # the fusion moved the first token: the comparison is not trivially 0
    assert count == 1 and total == pytest.approx(expected, rel=1e-3, abs=1e-7)
    assert metrics.registry.get_sample_value("ragkv_fusion_fidelity_samples_dropped_total") == 0


@pytest.mark.model
def test_rate_zero_samples_nothing_and_a_full_recompute_is_never_sampled(engine):
    for rate, strategy in ((0.0, Probe(ratio=0.1)), (1.0, Full())):
        metrics = Metrics()
        scheduler = _scheduler(engine, rate, metrics)
        fused: list = []
        scheduler.add(_fused_request(engine, strategy, fused))
        scheduler.run_until_done()
        assert not scheduler.has_idle_work
        scheduler.step()  # idle: nothing to measure
        assert _kl_samples(metrics, strategy.name) == (None, None)
    assert fused_prompt_ids(fused[0]) is None  # full reused nothing


@pytest.mark.model
def test_a_request_arriving_during_a_sample_prefill_is_admitted_at_the_next_step(engine):
    metrics = Metrics()
    scheduler = _scheduler(engine, 1.0, metrics, piece_tokens=PIECE)
    fused: list = []
    scheduler.add(_fused_request(engine, Probe(ratio=0.1), fused))
    scheduler.run_until_done()
    scheduler.step()  # idle: the first piece of the sample's full prefill
    fidelity = scheduler.fidelity
    assert fidelity.current is not None and fidelity.current[1].prefilled == PIECE
    late = _prefill_request(engine)
    scheduler.add(late)
    scheduler.step()
    # admitted at once: the sample paused after its piece and did not run in this step
    assert late.phase is Phase.DECODING and late.sink.start is not None
    assert fidelity.current[1].prefilled == PIECE and fidelity.measured == 0
    while scheduler.has_work:  # the sample waits while a request runs
        scheduler.step()
        assert fidelity.current[1].prefilled == PIECE
    assert late.sink.completion is not None
    while scheduler.has_idle_work:  # then it goes on from where it paused
        scheduler.step()
    count, total = _kl_samples(metrics, "probe")
    assert count == 1 and total == pytest.approx(_reference_kl(engine, fused[0]), rel=1e-3, abs=1e-7)


@pytest.fixture(scope="module")
def rag(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("live-fidelity")
    env = LMDBEnvironment(root / "db")
    store = LMDBStore(root / "chunks")
    embedder = Embedder()
    config = IngestConfig(chunk_tokens=48, show_progress=False)
    ingestor = Ingestor(engine, store, LMDBDocumentRegistry(env), embedder, IngestJournal(env), config)
    ingestor.ingest_text(" ".join(TEXTS), "places.txt")
    yield RagPipeline(engine, store, ingestor.registry, embedder)
    store.close()
    env.close()


@pytest.mark.model
def test_a_rag_query_and_a_rag_chat_turn_keep_their_fused_prompts(engine, rag):
    metrics = Metrics()
    scheduler = _scheduler(engine, 1.0, metrics)
    # min_rows=0: documents this short are otherwise recomputed whole (nothing to sample)
    fusion = FusionConfig("probe:min_rows=0")
    config = QueryConfig(top_k=2, fusion=fusion, generation=GenerationConfig(max_new_tokens=3))
    turns = ChatTurns(rag, ContextCache(1 << 30, 1 << 30, 600))
    messages = [{"role": "user", "content": QUESTION}]
    requests = [
        query_request(rag, QUESTION, "default", config),
        turns.request(ChatTurn("default", messages, None, True, config)),
        turns.request(ChatTurn("default", messages, None, False, config)),  # a prefill: not sampled
    ]
    for request in requests:
        request.sink = CollectingSink()
        scheduler.add(request)
    scheduler.run_until_done()
    assert all(request.sink.completion is not None for request in requests)
    pending = list(scheduler.fidelity.pending)
    assert [sample.strategy for sample in pending] == ["probe", "probe"]
    query_ids, chat_ids = (sample.prompt_ids for sample in pending)
    question_ids = engine.prompt.rag_segments(QUESTION).question_ids
    assert query_ids[-len(question_ids) :] == question_ids  # the question closes the fused prompt
    assert len(chat_ids) > len(engine.tokenize(QUESTION))
    while scheduler.has_idle_work:
        scheduler.step()
    assert _kl_samples(metrics, "probe")[0] == 2


@pytest.mark.model
def test_the_model_worker_measures_samples_when_nothing_else_runs(engine):
    metrics = Metrics()
    scheduler = _scheduler(engine, 1.0, metrics, piece_tokens=PIECE)
    scheduler.add(_fused_request(engine, Probe(ratio=0.1), []))
    scheduler.run_until_done()
    fidelity = scheduler.fidelity
    worker = ModelWorker(scheduler)
    worker.start()
    try:
        deadline = time.monotonic() + 300  # generous: a loaded machine is slow
        while not (fidelity.measured or fidelity.dropped) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.stop()
    assert _kl_samples(metrics, "probe")[0] == 1 and fidelity.dropped == 0


def test_the_queue_of_samples_is_bounded_dropping_the_oldest():
    dropped: list = []
    fidelity = LiveFidelity(LiveFidelityConfig(rate=1.0, max_pending=2), on_dropped=lambda: dropped.append(1))
    samples = [FidelitySample([1, 2, 3], torch.zeros(4), f"s{i}") for i in range(3)]
    for index, sample in enumerate(samples):
        fidelity._chosen[index] = sample
        fidelity.finished(type("Finished", (), {"id": index})())
    assert [s.strategy for s in fidelity.pending] == ["s1", "s2"] and fidelity.dropped == 1 and dropped == [1]


@pytest.mark.model
def test_chunked_prefill_gives_the_full_prefill_logits(engine):
    ids = engine.tokenize(TEXTS[0])
    prefill = ChunkedPrefill(engine.model, ids, 7)
    pieces = 0
    while not prefill.step():
        pieces += 1
    assert pieces + 1 == -(-len(ids) // 7) and prefill.cache is None
    _, reference = engine.prefill(ids)
    torch.testing.assert_close(prefill.logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_a_sample_rate_outside_zero_one_is_refused(rate, tmp_path, capsys):
    with pytest.raises(ValueError, match="fidelity_sample_rate must be in"):
        ServeConfig(fidelity_sample_rate=rate)
    with pytest.raises(ValueError, match="sample rate must be in"):
        LiveFidelityConfig(rate=rate)
    code = main(["serve", "--data-dir", str(tmp_path), "--fidelity-sample-rate", str(rate)])
    assert code == 2
    assert "fidelity_sample_rate must be in [0, 1]" in capsys.readouterr().err
