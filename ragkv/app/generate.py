"""Running requests on a scheduler of their own, for callers without a server: `ragkv ask`,
the benchmarks and the tests. The text is generated exactly as the server generates it
(the same scheduler step, sampler and incremental detokenizer); only the batch is one.
"""

from __future__ import annotations

import torch

from ragkv.app.completion import completion_request
from ragkv.app.request import Prepared, Request, RequestOutput, Started
from ragkv.app.scheduler import Scheduler, SchedulerConfig
from ragkv.app.usage import TokenUsage
from ragkv.engine import Engine
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import DecodeAttention


class CollectingSink:
    """A sink that keeps the pieces of text and the completion (or the error)."""

    cancelled = False

    def __init__(self):
        self.start: Started | None = None
        self.pieces: list[str] = []
        self.completion: RequestOutput | None = None
        self.error: BaseException | None = None

    def started(self, started: Started) -> None:
        self.start = started

    def token(self, text: str) -> None:
        self.pieces.append(text)

    def finished(self, completion: RequestOutput) -> None:
        self.completion = completion

    def failed(self, error: BaseException) -> None:
        self.error = error


def run_alone(
    engine: Engine, request: Request, sink: CollectingSink | None = None, config: SchedulerConfig = SchedulerConfig()
) -> RequestOutput:
    """Run `request` to its end on a scheduler of its own; its completion, or its error raised."""
    sink = sink if sink is not None else CollectingSink()
    request.sink = sink
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids, config)
    scheduler.add(request)
    scheduler.run_until_done()
    if sink.error is not None:
        raise sink.error
    return sink.completion


def decode(
    engine: Engine,
    cache: KVCache,
    logits: torch.Tensor,
    generation: GenerationConfig,
    attention: DecodeAttention | None = None,
    *,
    strategy: str = "none",
    sink: CollectingSink | None = None,
) -> RequestOutput:
    """Decode from a prompt already in `cache`, whose last row produced `logits` (a fused or
    prefilled prompt); `attention`: sparse decode attention, None = dense. The cache keeps
    every row, so the caller may cut it back to the prompt afterwards."""

    def prepare(request: Request) -> Prepared:
        return Prepared(cache, logits, TokenUsage(prompt_tokens=cache.length), strategy, attention=attention)

    keep_rows = SchedulerConfig(release_window_rows=False)
    return run_alone(engine, Request("decode", prepare, generation, strip_text=False), sink, keep_rows)


def forced_answer_ids(completion: RequestOutput) -> list[int]:
    """The completion's tokens with the end-of-sequence token that ended them, if one did:
    what teacher forcing feeds back, so the position that predicts the end is compared too."""
    return completion.token_ids + ([completion.eos_token] if completion.eos_token is not None else [])


def complete(
    engine: Engine, token_ids: list[int], generation: GenerationConfig, sink: CollectingSink | None = None
) -> RequestOutput:
    """Continue `token_ids` with a plain prefill: what /v1/completions does."""
    return run_alone(engine, completion_request(engine, token_ids, generation), sink)
