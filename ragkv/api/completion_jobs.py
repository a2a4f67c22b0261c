"""Model worker bodies of /v1/completions and /v1/embeddings (see api.worker for bodies).

A plain completion continues each prompt as it is (no chat template). Several prompts run
one after another in one job; what the body yields is tagged with the prompt's index:
("prepared", (i, info)), ("token", (i, text)). (With `rag.enabled` the route runs the
/v1/query request instead.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ragkv.app.logprobs import TokenLogprob, token_logprob
from ragkv.app.runtime import Runtime
from ragkv.engine.generation import GenerationConfig
from ragkv.ingest.errors import InputError

Body = Callable[[object], Generator]


@dataclass
class CompletionOutcome:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    citations: list[dict] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


def _tagged(index: int, generator: Generator) -> Generator:
    """Re-yield `generator`'s (kind, value) items as (kind, (index, value)); its return value."""
    try:
        while True:
            try:
                kind, value = next(generator)
            except StopIteration as stop:
                return stop.value
            yield kind, (index, value)
    finally:
        generator.close()


def plain_completions_body(runtime: Runtime, prompts: Sequence[str | list[int]], generation: GenerationConfig,
                           max_input_tokens: int) -> Body:
    engine = runtime.engine
    limit = engine.spec.rope.max_position_embeddings
    vocabulary = engine.spec.vocab_size

    def token_ids(prompt: str | list[int], index: int) -> list[int]:
        ids = engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        where = f"prompt {index}" if len(prompts) > 1 else "the prompt"
        if not ids:
            raise InputError("empty_prompt", f"{where} has no tokens")
        if max(ids) >= vocabulary:
            raise InputError("bad_token_id", f"{where} holds token id {max(ids)}; the vocabulary has {vocabulary}")
        if len(ids) > max_input_tokens:
            raise InputError("too_many_tokens", f"{where} is {len(ids)} tokens; the limit is {max_input_tokens}")
        if len(ids) + generation.max_new_tokens > limit:
            raise InputError("context_length_exceeded", f"{where} is {len(ids)} tokens and max_tokens is "
                             f"{generation.max_new_tokens}: above the model's context of {limit}")
        return ids

    def one(ids: list[int]) -> Generator:
        started = time.perf_counter()
        cache, logits = engine.prefill(ids, generation.max_new_tokens)
        yield "prepared", {"ttft": round(time.perf_counter() - started, 4)}
        pieces, finish, generated = [], "length", 0
        logprobs = [] if generation.logprobs is not None else None
        for event in engine.stream(cache, logits, generation):
            generated += 1
            finish = event.finish_reason or finish
            if logprobs is not None and event.finish_reason != "eos":  # the end of sequence is no answer token
                entry = token_logprob(event.logits, event.token_id, generation.logprobs, engine.tokenizer)
                logprobs.append(entry)
                yield "logprob", entry
            if event.text:
                pieces.append(event.text)
                yield "token", event.text
        return CompletionOutcome("".join(pieces), finish, len(ids), generated, logprobs=logprobs)

    def body(job) -> Generator:
        all_ids = [token_ids(prompt, index) for index, prompt in enumerate(prompts)]  # refuse before any work
        outcomes = []
        for index, ids in enumerate(all_ids):
            outcomes.append((yield from _tagged(index, one(ids))))
        return outcomes

    return body


def embeddings_body(runtime: Runtime, texts: list[str]) -> Body:
    """(vectors [n, dimension] float32 unit rows, tokens read) for the texts."""
    embedder = runtime.embedder

    def body(job) -> Generator:
        tokenizer = embedder.model.tokenizer
        tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"])
        vectors = np.asarray(embedder.embed_passages(texts), dtype=np.float32)
        return vectors, tokens
        yield  # a generator: embedding is one step

    return body

