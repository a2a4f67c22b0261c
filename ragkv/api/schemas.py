"""Request schemas, and their conversion into the engine's typed configs.

Pydantic checks shapes and ranges; the typed configs (QueryConfig, FusionConfig,
GenerationConfig, SamplingConfig) check the rest when they are built at the boundary,
and their ValueError becomes a 400 that carries the config's own message. Text anywhere in
a request must be valid Unicode: a lone UTF-16 surrogate (JSON "\udc80") is refused.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from ragkv.api.config import ServeConfig
from ragkv.api.errors import ApiError
from ragkv.app.chat import ChatTurn
from ragkv.app.rag import QueryConfig
from ragkv.app.request_types import (
    DEFAULT_STRATEGY,
    MAX_LOGPROBS,
    RETRIEVAL_MODES,
    SELECTOR_NAMES,
    STRATEGY_NAMES,
    FusionConfig,
    GenerationConfig,
    MetadataFilter,
    SamplingConfig,
    SparseConfig,
)
from ragkv.ingest.errors import InputError

MAX_METADATA_BYTES = 16 * 1024
DEFAULT_MAX_TOKENS = 128
# I-JSON safe integers: every JSON parser reads them exactly (a 64-bit seed may not survive
# a client's float conversion, and 2**64 - 1 is not representable as a double).
SEED_MIN, SEED_MAX = -(2**53 - 1), 2**53 - 1

# Exact integers (the generated bounds would be floats).
SEED_SCHEMA = {"anyOf": [{"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}, {"type": "null"}]}

_SURROGATE = re.compile("[\ud800-\udfff]")


def unpaired_surrogate_at(value: Any, where: str = "body") -> str | None:
    """Where in a decoded JSON value a lone UTF-16 surrogate sits (json.loads keeps one
    when the text escapes half a pair); None when all text is valid Unicode."""
    if isinstance(value, str):
        return where if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and _SURROGATE.search(key):
                return f"{where} (a key)"
            found = unpaired_surrogate_at(item, f"{where}.{key}" if where != "body" else str(key))
            if found:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = unpaired_surrogate_at(item, f"{where}[{index}]")
            if found:
                return found
    return None


class UnicodeText(BaseModel):
    # Strict types: JSON true is not the number 1, "5" is not an integer (as the schema says).
    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = unpaired_surrogate_at(data)
        if where is not None:
            raise ValueError(f"{where} holds an unpaired UTF-16 surrogate: text must be valid Unicode")
        return data


class _Strict(UnicodeText):
    model_config = ConfigDict(extra="forbid")


DOC_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"
SESSION_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
# Text that is not blank. Checked by a validator (for its message) and declared as a
# pattern (JSON Schema patterns search: some character that is not white space).
NOT_BLANK_SCHEMA = {"pattern": r"\S"}


def not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty or only white space")
    return value


NotBlank = Annotated[str, AfterValidator(not_blank)]


def _integral(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer: a number with no fraction is that integer."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(_integral)]
"""An integer field of a request: JSON's 3 or 3.0 (as the published schema's `integer`
allows), never "3" or true (the models are strict)."""

Stop = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]
    | None
)
STOP_DESCRIPTION = "up to 4 non-empty strings that end the answer (not included)"


class RetrievalOptions(_Strict):
    """Retrieval and fusion options shared by /v1/query and the chat `rag` field."""

    top_k: Integer = Field(5, ge=1, description="chunks retrieved (the server caps it, see --max-top-k)")
    document_ids: list[Annotated[str, Field(pattern=DOC_ID_PATTERN)]] | None = Field(
        None, min_length=1, max_length=256, description="restrict retrieval to these documents"
    )
    strategy: str = Field(
        DEFAULT_STRATEGY,
        json_schema_extra={"pattern": rf"^({'|'.join(STRATEGY_NAMES)})(:.+)?$"},
        description="fusion strategy spec: a name ("
        + ", ".join(STRATEGY_NAMES)
        + ") or name:option=value,... (e.g. a3:ratio=0.3)",
    )
    ratio: float | None = Field(
        None, ge=0, le=1, description="share of document tokens recomputed (a3, cacheblend); overrides the spec's"
    )
    retrieval: Literal[RETRIEVAL_MODES] | None = Field(
        None,
        description="dense (embeddings), bm25 (words) or hybrid (both, fused by reciprocal rank); "
        "default: the server's --retrieval",
    )
    filter: dict[str, Any] | None = Field(
        None,
        min_length=1,
        description='retrieve only from documents whose metadata matches: {"team": "legal"}, '
        '{"team": {"$in": ["legal", "hr"]}}, {"year": {"$gte": 2020}} ($gt, $gte, $lt, $lte, $ne); every key must hold',
    )

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        name = value.split(":", 1)[0]
        if name not in STRATEGY_NAMES or value == name + ":":
            raise ValueError(f"unknown fusion strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
        return value


class SparseOptions(_Strict):
    """Sparse decode options of /v1/query (a chat session decodes dense: it keeps its exact KV)."""

    selector: str = Field(
        "dense",
        json_schema_extra={"pattern": rf"^({'|'.join(SELECTOR_NAMES)})(:.+)?$"},
        description="decode attention selector spec: a name ("
        + ", ".join(SELECTOR_NAMES)
        + ") or name:option=value,... (e.g. a2ats:rerank=0)",
    )
    budget: float | None = Field(
        None,
        gt=0,
        description="sparse decode budget per KV head, sinks and recent window "
        "included: a fraction of the cached rows in (0, 1] or a whole row count > 1",
        json_schema_extra={
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                {"type": "integer", "minimum": 2},
                {"type": "null"},
            ]
        },
    )
    head_aggregation: Literal["probs", "logits"] | None = Field(
        None,
        description="how a KV head's query heads combine their scores when rows are chosen: 'probs' (summed "
        "estimated probabilities) or 'logits' (summed logits: cheaper); default: the selector's own ('logits' for "
        "a2ats, 'probs' for the others)",
    )
    snapkv_capacity: Integer | None = Field(
        None,
        ge=1,
        description="SnapKV: prompt rows kept per layer and KV head after "
        "the first token (None: no eviction); at least the prefix and question rows "
        "(else 400 snapkv_capacity_too_small)",
    )

    @field_validator("selector")
    @classmethod
    def _known_selector(cls, value: str) -> str:
        name = value.split(":", 1)[0]
        if name not in SELECTOR_NAMES or value == name + ":":
            raise ValueError(f"unknown selector {name!r}; choose one of {', '.join(SELECTOR_NAMES)}")
        return value

    @property
    def wants_sparse(self) -> bool:
        return (
            self.selector.split(":", 1)[0] != "dense"
            or self.budget is not None
            or self.head_aggregation is not None
            or self.snapkv_capacity is not None
        )


class QueryRequest(RetrievalOptions, SparseOptions):
    question: NotBlank = Field(
        min_length=1,
        max_length=100_000,
        json_schema_extra=NOT_BLANK_SCHEMA,
        description="the question, answered from the tenant's documents",
    )
    max_tokens: Integer = Field(DEFAULT_MAX_TOKENS, ge=1, description="tokens to generate at most (the server caps it)")
    temperature: float = Field(0.0, ge=0, le=10, description="0: greedy decoding; above 0: sampling")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (with temperature > 0)")
    seed: Integer | None = Field(
        None,
        ge=SEED_MIN,
        le=SEED_MAX,
        json_schema_extra=SEED_SCHEMA,
        description="seed of the sampler (64 bits); greedy ignores it",
    )
    stop: Stop = Field(None, description=STOP_DESCRIPTION)
    stream: StrictBool = Field(False, description="answer as server-sent events: retrieval, token..., done, [DONE]")


class DocumentCreate(_Strict):
    text: NotBlank = Field(json_schema_extra=NOT_BLANK_SCHEMA, description="the document's text")
    name: str = Field("document.txt", min_length=1, max_length=256, description="a name shown in citations")
    metadata: dict[str, Any] | None = Field(
        None, description=f"a JSON object kept with the document (at most {MAX_METADATA_BYTES} bytes)"
    )
    background: StrictBool | None = Field(
        None, description="force (true) or refuse (false) a background job; default by size"
    )
    replace: StrictBool = Field(
        False,
        description="POST only: a document of the same name replaces the tenant's newest one of that "
        "name (as PUT does) instead of being added beside it",
    )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(json_schema_extra={"enum": ["text"]}, description="only text parts are served")
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
                raise ApiError(
                    400,
                    "unsupported_content",
                    f"message content parts of type {part.type!r} are not supported; send text",
                    param="messages",
                )
            parts.append(part.text)
        return "".join(parts)


class ChatRag(RetrievalOptions):
    enabled: StrictBool = Field(True, description="retrieve documents for this turn")
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN, description="the same as the top-level session_id")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = Field(False, description="send a last chunk with the token usage (and empty choices)")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(
        json_schema_extra={"enum": ["text"]},
        description="'text' is served; 'json_object' and 'json_schema' are refused with 400 "
        "(the server does not constrain decoding to JSON)",
    )


class GenerationRequest(UnicodeText):
    """What chat completions, completions and responses share: the model named and sampling.
    OpenAI clients send fields this server does not use (user, metadata, ...): they are
    ignored, except those whose meaning cannot be honoured, which each endpoint refuses."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(
        min_length=1, examples=["ragkv"], description="the served model's id (GET /v1/models) or the alias 'ragkv'"
    )
    temperature: float | None = Field(None, ge=0, le=10, description="0 or absent: greedy decoding; above 0: sampling")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling mass (with temperature > 0)")
    seed: Integer | None = Field(
        None,
        ge=SEED_MIN,
        le=SEED_MAX,
        json_schema_extra=SEED_SCHEMA,
        description="seed of the sampler (64 bits); greedy decoding ignores it",
    )
    prompt_spans: StrictBool | None = Field(
        None,
        description="reuse the KV of passages pasted into the prompt from the chunk store, wherever "
        "they stand (new passages are stored for the next request); absent: the server's "
        "--prompt-spans setting",
    )


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(
        min_length=1,
        description="the conversation; the last message must be the "
        "user's. With a session only the last message is new: earlier ones are "
        "already in the session's KV",
    )
    max_tokens: Integer | None = Field(
        None,
        ge=1,
        description=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}; "
        "the server caps it, see --max-new-tokens)",
    )
    max_completion_tokens: Integer | None = Field(
        None, ge=1, description="the same as max_tokens (OpenAI's newer name); wins when both are given"
    )
    stop: Stop = Field(None, description=STOP_DESCRIPTION)
    stream: StrictBool = Field(
        False, description="answer as server-sent events (chat.completion.chunk objects, then [DONE])"
    )
    stream_options: StreamOptions | None = Field(None, description="streaming options: include_usage")
    n: Integer = Field(1, ge=1, le=1, description="choices per request: only 1 is served")
    logprobs: StrictBool | None = Field(
        None, description="true: return each answer token's log-probability (choices[].logprobs)"
    )
    top_logprobs: Integer | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="with logprobs: also the N most likely tokens at each position"
    )
    response_format: ResponseFormat | None = Field(None, description="only {'type': 'text'} is served")
    rag: ChatRag | None = Field(None, description="ragkv extension: retrieval, fusion and session options")
    sources: StrictBool = Field(
        False,
        description="ragkv extension: end the message content with numbered source markers, "
        "a 'Sources:' block and the session id (for clients that read only the text)",
    )
    session_id: str | None = Field(
        None,
        pattern=SESSION_ID_PATTERN,
        description="ragkv extension: continue this chat session (its KV is kept "
        "server-side); a new id is made when absent and returned as session_id",
    )

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in ("tools", "functions", "tool_choice", "function_call"):
            if extra.get(name):
                raise ApiError(400, "unsupported_parameter", f"{name} are not supported by this server", param=name)
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "invalid_parameters", "top_logprobs needs logprobs: true", param="top_logprobs")
        refuse_response_format(self.response_format)

    @property
    def logprobs_count(self) -> int | None:
        """GenerationConfig.logprobs: None = off, else the alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


def refuse_response_format(response_format: ResponseFormat | None) -> None:
    if response_format is not None and response_format.type != "text":
        raise ApiError(
            400,
            "unsupported_parameter",
            f"response_format {response_format.type!r} is not supported: this "
            "server does not constrain decoding to JSON; send {'type': 'text'} or leave it out",
            param="response_format",
        )


# -- conversion to the typed configs -----------------------------------------------------


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


def query_config(options: RetrievalOptions, generation: GenerationConfig, limits: ServeConfig) -> QueryConfig:
    if options.top_k > limits.max_top_k:
        raise ApiError(
            400,
            "invalid_parameters",
            f"top_k is {options.top_k}; this server allows at most {limits.max_top_k}",
            param="top_k",
        )
    try:
        fusion = FusionConfig(strategy=options.strategy, ratio=options.ratio)
        extra = {}
        if isinstance(options, SparseOptions) and options.wants_sparse:
            extra["sparse"] = sparse_config(options)
        return QueryConfig(
            top_k=options.top_k,
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
    if SparseConfig is None:
        raise ApiError(400, "unsupported_selector", "this build serves dense decode only", param="selector")
    values = {"selector": options.selector}
    if options.budget is not None:
        values["budget"] = options.budget
    if options.head_aggregation is not None:
        values["head_aggregation"] = options.head_aggregation
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
    where = unpaired_surrogate_at(metadata, "metadata")
    if where is not None:
        raise ApiError(
            400,
            "bad_metadata",
            f"{where} holds an unpaired UTF-16 surrogate: text must be valid Unicode",
            param="metadata",
        )
    if len(json.dumps(metadata)) > MAX_METADATA_BYTES:
        raise ApiError(
            413, "metadata_too_large", f"metadata must be at most {MAX_METADATA_BYTES} bytes of JSON", param="metadata"
        )
    return metadata
