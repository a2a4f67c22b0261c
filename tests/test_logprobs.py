"""Log-probabilities of generated tokens against a reference: a full prefill of the prompt
plus the answer, whose logits at each answer position are log-softmaxed independently of
the decode path (batched decode in the scheduler, where every kind of request decodes:
queries, chat turns and /v1/completions' plain completions)."""

from __future__ import annotations

import pytest
import torch

from ragkv.app.completion import completion_request
from ragkv.app.generate import CollectingSink
from ragkv.app.request import Prepared, Request
from ragkv.app.scheduler import Scheduler, SchedulerConfig
from ragkv.app.usage import TokenUsage
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.sampling import SamplingConfig

pytestmark = pytest.mark.model

QUESTIONS = ["Name three colours.", "What is the capital of France? Answer in one sentence."]


class LogprobSink(CollectingSink):
    def __init__(self):
        super().__init__()
        self.streamed = []

    def logprob(self, entry) -> None:
        self.streamed.append(entry)


def _request(engine, question: str, generation: GenerationConfig, sink) -> tuple[Request, list[int]]:
    ids = engine.prompt.encode_messages([{"role": "user", "content": question}])

    def prepare(request: Request) -> Prepared:
        cache, logits = engine.prefill(ids, generation.max_new_tokens)
        return Prepared(cache, logits, TokenUsage(prompt_tokens=len(ids)), "none")

    return Request("test", prepare, generation, sink), ids


def _reference(engine, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log-softmax of the logits that predict each answer token: a fresh full prefill of each
    prefix (prompt + the answer so far), no decode step involved."""
    sequence = prompt + answer
    rows = []
    for end in range(len(prompt), len(sequence)):
        rows.append(engine.model.prefill(torch.tensor(sequence[:end]), engine.model.new_cache(end)))
    return torch.log_softmax(torch.stack(rows).double(), dim=-1)


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, top_p=0.9, seed=7)], ids=["greedy", "sampled"]
)
def test_scheduler_logprobs_are_the_models_log_softmax_of_the_choosing_logits(engine, sampling):
    generation = GenerationConfig(max_new_tokens=8, sampling=sampling, logprobs=3)
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids, SchedulerConfig(max_running=2))
    sinks, prompts = [LogprobSink() for _ in QUESTIONS], []
    for question, sink in zip(QUESTIONS, sinks):
        request, ids = _request(engine, question, generation, sink)
        prompts.append(ids)
        scheduler.add(request)
    scheduler.run_until_done()  # the two decode in one batch
    for sink, prompt in zip(sinks, prompts):
        completion = sink.completion
        entries = completion.logprobs
        assert len(entries) == len(completion.token_ids) > 0
        assert sink.streamed == entries  # reported as they come, the same values
        reference = _reference(engine, prompt, completion.token_ids)
        for position, (entry, token) in enumerate(zip(entries, completion.token_ids)):
            assert entry.token_id == token and entry.text == engine.tokenizer.decode([token])
            assert entry.logprob == pytest.approx(float(reference[position, token]), abs=2e-3)
            assert len(entry.top) == 3
            assert [a.logprob for a in entry.top] == sorted((a.logprob for a in entry.top), reverse=True)
            expected = reference[position].topk(3)
            assert [a.token_id for a in entry.top][:1] == expected.indices.tolist()[:1]
            assert [a.logprob for a in entry.top] == pytest.approx(expected.values.tolist(), abs=2e-3)
            if sampling.temperature == 0:
                assert entry.top[0].token_id == token and entry.top[0].logprob == entry.logprob


def test_without_logprobs_nothing_is_computed(engine):
    sink = LogprobSink()
    request, _ = _request(engine, QUESTIONS[0], GenerationConfig(max_new_tokens=4), sink)
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids)
    scheduler.add(request)
    scheduler.run_until_done()
    assert sink.completion.logprobs is None and sink.streamed == []
    with pytest.raises(ValueError):
        GenerationConfig(logprobs=21)


def test_a_plain_completion_collects_logprobs_in_the_scheduler_batched_with_a_chat_request(engine):
    """/v1/completions' requests take the scheduler path too: their entries (EOS excluded)
    equal the reference, decoded in the same batch as another request."""
    generation = GenerationConfig(max_new_tokens=8, logprobs=2)
    chat_sink, plain_sink = LogprobSink(), LogprobSink()
    chat, chat_ids = _request(engine, QUESTIONS[0], generation, chat_sink)
    plain_ids = engine.tokenize("The three primary colours are")
    plain = completion_request(engine, plain_ids, generation, plain_sink)
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids, SchedulerConfig(max_running=2))
    scheduler.add(chat, plain)
    scheduler.run_until_done()
    for sink, prompt in ((plain_sink, plain_ids), (chat_sink, chat_ids)):
        completion = sink.completion
        entries = completion.logprobs
        assert len(entries) == len(completion.token_ids) > 0 and sink.streamed == entries
        reference = _reference(engine, prompt, completion.token_ids)
        for position, (entry, token) in enumerate(zip(entries, completion.token_ids)):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(reference[position, token]), abs=2e-3)
            assert entry.top[0].token_id == token  # greedy
            assert [a.logprob for a in entry.top] == pytest.approx(
                reference[position].topk(2).values.tolist(), abs=2e-3
            )
