"""A plain completion as a scheduler request: the prompt's ids prefilled as they are (no
chat template, no retrieval), then decoded in the same batched steps as the queries and
chat turns that run beside it.

The API's /v1/completions builds one request per prompt; the text is kept as generated
(not stripped): a completion continues its prompt exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ragkv.app.limits import check_context_length
from ragkv.app.passages import PromptPassages
from ragkv.app.passages.plan import PassagePlan
from ragkv.app.request import Fetched, Prepared, Request, RequestOutput, RequestSink, fused_prompt_ids
from ragkv.app.usage import TokenUsage
from ragkv.engine import Engine
from ragkv.engine.generation import GenerationConfig
from ragkv.errors import InputError
from ragkv.fusion import FusionConfig


def prompt_ids(
    engine: Engine,
    prompt: str | list[int],
    generation: GenerationConfig,
    *,
    max_input_tokens: int | None = None,
    where: str = "the prompt",
) -> list[int]:
    """The prompt's token ids (a text is tokenized, ids are checked); InputError when the
    prompt is empty, holds an id outside the vocabulary, is longer than `max_input_tokens`,
    or leaves no room for its answer in the model's context."""
    ids = engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    vocabulary = engine.spec.vocab_size
    if not ids:
        raise InputError("empty_prompt", f"{where} has no tokens")
    if max(ids) >= vocabulary:
        raise InputError("bad_token_id", f"{where} holds token id {max(ids)}; the vocabulary has {vocabulary}")
    if max_input_tokens is not None and len(ids) > max_input_tokens:
        raise InputError(
            "too_many_tokens", f"{where} is {len(ids)} tokens; the limit is {max_input_tokens} (--max-input-tokens)"
        )
    check_context_length(engine, len(ids), generation.max_new_tokens, where, "shorten it or lower max_tokens")
    return ids


@dataclass(frozen=True)
class PassageRequest:
    """Reuse the passages pasted into a completion's prompt (ragkv.app.passages)."""

    passages: PromptPassages
    tenant: str
    fusion: FusionConfig


@dataclass
class CompletionFetch(Fetched):
    plan: PassagePlan | None = None
    """The pasted passages and the rows the store gives; None: no passage (a prefill)."""


def completion_request(
    engine: Engine,
    token_ids: list[int],
    generation: GenerationConfig,
    sink: RequestSink | None = None,
    *,
    arrival: float | None = None,
    on_finished: Callable[[Request, RequestOutput], None] | None = None,
    passages: PassageRequest | None = None,
) -> Request:
    """A request that prefills `token_ids` (checked by `prompt_ids`) and continues them;
    with `passages`, the passages pasted into them are fused from the store instead."""

    def fetch(request: Request) -> CompletionFetch:
        plan = passages.passages.plan(passages.tenant, token_ids, 0) if passages is not None else None
        return CompletionFetch(plan.nbytes if plan is not None else 0, plan)

    def prepare(request: Request) -> Prepared:
        started = time.perf_counter()
        plan = request.fetched.plan if request.fetched is not None else None
        if plan is not None:
            strategy = passages.fusion.build(passages.passages.calibrated.fusion)
            fused = passages.passages.prepare_prompt(
                passages.tenant, token_ids, strategy, generation.max_new_tokens, plan=plan
            )
            if fused is not None:
                request.timings.prefill, request.timings.fuse = fused.prefill_s, fused.fuse_s
                fusion = fused.fusion
                return Prepared(
                    fusion.cache, fusion.logits, fused.usage, fused.strategy, fused_prompt_ids=fused_prompt_ids(fusion)
                )
        cache, logits = engine.prefill(token_ids, generation.max_new_tokens)
        request.timings.prefill = time.perf_counter() - started
        return Prepared(cache, logits, TokenUsage(prompt_tokens=len(token_ids)), "none")

    return Request(
        "completion",
        prepare,
        generation,
        sink,
        estimated_tokens=len(token_ids),
        arrival=arrival,
        on_finished=on_finished,
        strip_text=False,
        fetch=fetch if passages is not None else None,
    )
