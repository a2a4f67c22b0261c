"""Request schemas, and their conversion into the engine's typed configs.

Pydantic checks shapes and ranges; the typed configs (QueryConfig, FusionConfig,
GenerationConfig, SamplingConfig) check the rest when they are built at the boundary,
and their ValueError becomes a 422 that carries the config's own message.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ragkv.api.config import ServeConfig
from ragkv.api.errors import ApiError
from ragkv.fusion import DEFAULT_STRATEGY, FusionConfig
from ragkv.engine.generation import GenerationConfig
from ragkv.app.rag import QueryConfig
from ragkv.engine.sampling import SamplingConfig

try:  # sparse decode (ragkv.sparse) is optional in this layer: without it only dense decode is served
    from ragkv.sparse import SELECTOR_NAMES, SparseConfig
except ImportError:  # pragma: no cover - depends on the engine build
    SELECTOR_NAMES, SparseConfig = ("dense",), None

MAX_METADATA_BYTES = 16 * 1024
DEFAULT_MAX_TOKENS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RetrievalOptions(_Strict):
    """Retrieval, fusion and decode options shared by /v1/query and the chat `rag` field."""

    top_k: int = Field(5, ge=1, description="chunks retrieved")
    document_ids: list[str] | None = Field(None, min_length=1, max_length=256,
                                           description="restrict retrieval to these documents")
    strategy: str = Field(DEFAULT_STRATEGY, description="fusion strategy: full, full_reuse, pie, epic, cacheblend, a3")
    ratio: float = Field(0.15, description="share of document tokens recomputed (a3, cacheblend)")
    selector: str = Field("dense", description="decode attention selector: " + ", ".join(SELECTOR_NAMES))
    budget: float | None = Field(None, gt=0, description="sparse decode budget per KV head, sinks and recent window "
                                 "included: a fraction of the cached rows in (0, 1] or a whole row count > 1")
    snapkv_capacity: int | None = Field(None, ge=1, description="SnapKV: prompt rows kept per layer and KV head after "
                                        "the first token (None: no eviction)")

    @field_validator("selector")
    @classmethod
    def _known_selector(cls, value: str) -> str:
        if value not in SELECTOR_NAMES:
            raise ValueError(f"unknown selector {value!r}; one of {', '.join(SELECTOR_NAMES)}")
        return value

    @property
    def wants_sparse(self) -> bool:
        return self.selector != "dense" or self.budget is not None or self.snapkv_capacity is not None


class QueryRequest(RetrievalOptions):
    question: str = Field(min_length=1, max_length=100_000)
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False


class DocumentCreate(_Strict):
    text: str
    name: str = Field("document.txt", min_length=1, max_length=256)
    metadata: dict[str, Any] | None = None
    background: bool | None = Field(None, description="force (true) or refuse (false) a background job; default by size")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, "unsupported_content", f"message content parts of type {part.type!r} are not supported; send text",
                               param="messages")
            parts.append(part.text)
        return "".join(parts)


class ChatRag(RetrievalOptions):
    enabled: bool = Field(True, description="retrieve documents for this turn")
    session_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatRequest(BaseModel):
    # OpenAI clients send fields this server does not use (user, metadata, ...): ignored,
    # except those whose meaning cannot be honoured, refused below.
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    rag: ChatRag | None = None
    session_id: str | None = None

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        if self.n != 1:
            raise ApiError(400, "unsupported_parameter", "n must be 1: one choice per request", param="n")
        for name in ("tools", "functions", "tool_choice", "function_call"):
            if extra.get(name):
                raise ApiError(400, "unsupported_parameter", f"{name} are not supported by this server", param=name)
        if extra.get("logprobs"):
            raise ApiError(400, "unsupported_parameter", "logprobs are not supported by this server", param="logprobs")


# -- conversion to the typed configs -----------------------------------------------------

def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > 4:
        raise ApiError(422, "invalid_parameters", "at most 4 stop strings", param="stop")
    return stops


def generation_config(max_tokens: int, temperature: float | None, top_p: float | None, seed: int | None,
                      stop: str | list[str] | None, limits: ServeConfig) -> GenerationConfig:
    if max_tokens > limits.max_new_tokens:
        raise ApiError(422, "invalid_parameters", f"max_tokens is {max_tokens}; this server allows at most {limits.max_new_tokens}",
                       param="max_tokens")
    try:
        sampling = SamplingConfig(temperature=0.0 if temperature is None else temperature,
                                  top_p=1.0 if top_p is None else top_p, seed=seed)
        return GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, stop=_stops(stop))
    except ValueError as error:
        raise ApiError(422, "invalid_parameters", str(error)) from None


def query_config(options: RetrievalOptions, generation: GenerationConfig, limits: ServeConfig) -> QueryConfig:
    if options.top_k > limits.max_top_k:
        raise ApiError(422, "invalid_parameters", f"top_k is {options.top_k}; this server allows at most {limits.max_top_k}",
                       param="top_k")
    try:
        fusion = FusionConfig(strategy=options.strategy, ratio=options.ratio)
        extra = {}
        if options.wants_sparse:
            extra["sparse"] = sparse_config(options)
        return QueryConfig(top_k=options.top_k, doc_ids=tuple(options.document_ids) if options.document_ids else None,
                           fusion=fusion, generation=generation, **extra)
    except ValueError as error:
        raise ApiError(422, "invalid_parameters", str(error)) from None


def sparse_config(options: RetrievalOptions):
    """ValueError (-> 422) when the SparseConfig refuses the values."""
    if SparseConfig is None:
        raise ApiError(400, "unsupported_selector", "this build serves dense decode only", param="selector")
    values = {"selector": options.selector}
    if options.budget is not None:
        values["budget"] = options.budget
    if options.snapkv_capacity is not None:
        values["snapkv_capacity"] = options.snapkv_capacity
    return SparseConfig(**values)


def check_metadata(metadata: Any) -> dict | None:
    if metadata is None:
        return None
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as error:
            raise ApiError(400, "bad_metadata", f"metadata is not valid JSON: {error}", param="metadata") from None
    if not isinstance(metadata, dict):
        raise ApiError(400, "bad_metadata", "metadata must be a JSON object", param="metadata")
    if len(json.dumps(metadata)) > MAX_METADATA_BYTES:
        raise ApiError(413, "metadata_too_large", f"metadata must be at most {MAX_METADATA_BYTES} bytes of JSON", param="metadata")
    return metadata
