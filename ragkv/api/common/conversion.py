"""Request options into the application's typed configs.

Pydantic checks shapes and ranges; the typed configs (QueryConfig, FusionConfig,
GenerationConfig, SamplingConfig) check the rest when they are built at the boundary,
and their ValueError becomes a 400 that carries the config's own message."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ragkv.api.common.protocol import GenerationRequest, RetrievalOptions, SparseOptions
from ragkv.api.config import ServeConfig
from ragkv.api.errors import ApiError
from ragkv.app.chat.turn import ChatTurn
from ragkv.app.errors import InputError
from ragkv.app.rag import QueryConfig
from ragkv.app.request_types import (
    FusionConfig,
    GenerationConfig,
    MetadataFilter,
    SamplingConfig,
    SparseConfig,
)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > 4:
        raise ApiError(400, "invalid_parameters", "at most 4 stop strings", param="stop")
    return stops


def generation_config(
    max_tokens: int,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: str | list[str] | None,
    limits: ServeConfig,
    logprobs: int | None = None,
) -> GenerationConfig:
    if max_tokens > limits.max_new_tokens:
        raise ApiError(
            400,
            "invalid_parameters",
            f"max_tokens is {max_tokens}; this server allows at most {limits.max_new_tokens}",
            param="max_tokens",
        )
    try:
        sampling = SamplingConfig(
            temperature=0.0 if temperature is None else temperature, top_p=1.0 if top_p is None else top_p, seed=seed
        )
        return GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, stop=_stops(stop), logprobs=logprobs)
    except ValueError as error:
        raise ApiError(400, "invalid_parameters", str(error)) from None


def sent_or_capped(body: BaseModel, name: str, cap: int) -> Any:
    """The body's field `name` as the client sent it, or its default lowered to the server's
    cap: only a value sent above a cap is refused (the schema says the cap; a default that
    exceeds it is the server's to lower)."""
    value = getattr(body, name)
    return value if name in body.model_fields_set or value is None else min(value, cap)


def query_config(options: RetrievalOptions, generation: GenerationConfig, limits: ServeConfig) -> QueryConfig:
    top_k = sent_or_capped(options, "top_k", limits.max_top_k)
    if top_k > limits.max_top_k:
        raise ApiError(
            400,
            "invalid_parameters",
            f"top_k is {top_k}; this server allows at most {limits.max_top_k}",
            param="top_k",
        )
    try:
        fusion = FusionConfig(strategy=options.strategy, ratio=options.ratio)
        extra = {}
        if isinstance(options, SparseOptions) and options.wants_sparse:
            extra["sparse"] = sparse_config(options)
        return QueryConfig(
            top_k=top_k,
            doc_ids=tuple(options.document_ids) if options.document_ids else None,
            fusion=fusion,
            generation=generation,
            retrieval=options.retrieval or limits.retrieval,
            filter=metadata_filter(options.filter),
            **extra,
        )
    except ValueError as error:
        raise ApiError(400, "invalid_parameters", str(error)) from None


def prompt_spans_of(body: GenerationRequest, limits: ServeConfig) -> bool:
    """Whether a request reuses the passages pasted into it: its own `prompt_spans`, else the
    server's `--prompt-spans`."""
    return limits.prompt_spans if body.prompt_spans is None else body.prompt_spans


def chat_turn(
    tenant: str,
    messages: list[dict[str, str]],
    session_id: str | None,
    config: QueryConfig,
    rag_enabled: bool,
    body: GenerationRequest,
    limits: ServeConfig,
) -> ChatTurn:
    """The chat turn chat completions and responses both run. `session_id`: the session the
    client named (None: the longest cached prefix)."""
    return ChatTurn(tenant, messages, session_id, rag_enabled, config, prompt_spans_of(body, limits))


def metadata_filter(raw: dict | None) -> MetadataFilter | None:
    """The request's metadata filter, parsed once; a 400 naming what is wrong."""
    if raw is None:
        return None
    try:
        return MetadataFilter.parse(raw)
    except InputError as error:
        raise ApiError(400, error.reason, str(error), param="filter") from None


def sparse_config(options: SparseOptions):
    """ValueError (-> 400) when the SparseConfig refuses the values."""
    values = {"selector": options.selector}
    if options.budget is not None:
        values["budget"] = options.budget
    if options.head_aggregation is not None:
        values["head_aggregation"] = options.head_aggregation
    if options.snapkv_capacity is not None:
        values["snapkv_capacity"] = options.snapkv_capacity
    return SparseConfig(**values)


def checked_conversation(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A chat turn's messages: developer messages become system ones. A conversation that
    does not end with the user's message (OpenAI answers it too) is answered as if an empty
    one followed, and a blank one is answered as it is (it retrieves nothing): the turn
    always answers a user message."""
    converted = [
        {**message, "role": "system" if message["role"] == "developer" else message["role"]} for message in messages
    ]
    if not converted or converted[-1]["role"] != "user":
        converted.append({"role": "user", "content": ""})
    return converted
