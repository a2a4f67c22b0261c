"""What several endpoints' protocols share: the request bases (strict, valid Unicode,
JSON integers), retrieval, sparse and generation options, and the response parts every
endpoint sends alike (citations, usage, the `rag` extension, errors)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from ragkv.api.errors import ApiError
from ragkv.app.request_types import (
    DEFAULT_STRATEGY,
    MAX_FILTER_KEYS,
    MAX_FILTER_VALUES,
    RETRIEVAL_MODES,
    SELECTOR_NAMES,
    STRATEGY_NAMES,
)


def omitted_when_none(description: str | None = None) -> Any:
    """A field left out of the body, not sent as null, when it has no value."""
    return Field(None, exclude_if=lambda value: value is None, description=description)


class ApiObject(BaseModel):
    """What an answer's body opens with: its id, then the kind of object it is."""

    id: str
    object: str


class OpenAIObject(ApiObject):
    """An OpenAI answer's opening: id, object, then when it was made and by which model."""

    created: int
    model: str


class ErrorDetail(BaseModel):
    message: str = Field(description="what is wrong, for a person")
    type: str = Field(
        description="invalid_request_error, authentication_error, not_found_error, conflict_error, "
        "overloaded_error or api_error"
    )
    code: str | None = Field(description="short machine-readable reason")
    param: str | None = Field(None, description="the request field at fault, when there is one")


class ErrorResponse(BaseModel):
    """Every error, 4xx or 5xx, in the OpenAI shape."""

    error: ErrorDetail
    request_id: str | None = Field(None, description="quote it to the operator (also the X-Request-Id header)")


class Citation(BaseModel):
    """A retrieved chunk the answer was fused from."""

    document_id: str = Field(description="the document's id")
    name: str = Field(description="the document's name")
    chunk_index: int = Field(description="the chunk's position in its document")
    char_start: int = Field(description="where the chunk starts in the document's text")
    char_end: int = Field(description="where it ends (exclusive)")
    score: float = Field(description="retrieval score: higher is more relevant")
    text: str = Field(description="the chunk's text")
    page: int | None = Field(
        None, description="1-based page where the chunk starts (PDF); null for formats without pages"
    )
    page_end: int | None = Field(
        None,
        description="1-based page where the chunk ends (PDF; a chunk may span pages page..page_end); "
        "null for formats without pages",
    )


class Usage(BaseModel):
    """Token counts of one answer (ragkv.app.usage defines each)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = Field(description="prompt tokens whose KV was read, not computed (stored chunks, a session)")
    computed_tokens: int = Field(description="prompt tokens whose KV was computed for this request")
    recomputed_tokens: int = Field(
        description="document tokens computed: selective recompute and chunks the store "
        "could not give (miss, corrupt blob)"
    )
    document_tokens: int = Field(description="prompt tokens of retrieved chunks")


class CachedTokens(BaseModel):
    cached_tokens: int


class OpenAIUsage(Usage):
    """OpenAI's usage object, ragkv's counts beside it."""

    prompt_tokens_details: CachedTokens = Field(description="OpenAI's form of cached_tokens")


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool


class SessionSummary(BaseModel):
    id: str
    turns: int
    tokens: int
    chunks: int
    created: float
    updated: float
    shared: bool | None = omitted_when_none("another replica can continue it by its id (a chat answer's session)")


class RagExtension(BaseModel):
    """ragkv's `rag` object beside an OpenAI answer."""

    session_id: str
    turn: int
    strategy: str
    new_chunks: int = Field(description="chunks fused for this turn (not held by the context it started from)")
    context_tokens: int = Field(description="prompt rows taken from a cached context")
    citations: list[Citation]
    timings: dict[str, float]
    session: SessionSummary | None = Field(description="the context the turn left")


EMBEDDING_MODEL_ID = "all-MiniLM-L6-v2"

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


class StrictRequest(UnicodeText):
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


def joined_text(parts: list, types: tuple[str, ...], param: str, what: str, send: str) -> str:
    """The text of a message's content parts; 400 unsupported_content for a part of another
    type or without text (`what` names the parts, `send` the type to send instead)."""
    pieces = []
    for part in parts:
        if part.type not in types or part.text is None:
            raise ApiError(
                400, "unsupported_content", f"{what} of type {part.type!r} are not supported; send {send}", param=param
            )
        pieces.append(part.text)
    return "".join(pieces)


def known_spec(value: str, names: tuple[str, ...], kind: str) -> str:
    """`value` if it is a spec string (name or name:option=value,...) of a known name."""
    name = value.split(":", 1)[0]
    if name not in names or value == name + ":":
        raise ValueError(f"unknown {kind} {name!r}; choose one of {', '.join(names)}")
    return value


def seed_field(description: str) -> Any:
    """A sampler seed: an exact JSON integer (I-JSON safe), or null."""
    return Field(None, ge=SEED_MIN, le=SEED_MAX, json_schema_extra=SEED_SCHEMA, description=description)


_FILTER_SCALAR = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}
FILTER_SCHEMA = {
    "type": "object",
    "minProperties": 1,
    "maxProperties": MAX_FILTER_KEYS,
    "propertyNames": {"minLength": 1, "pattern": "^[^$]"},
    "additionalProperties": {
        "anyOf": [
            _FILTER_SCALAR,
            {
                "type": "object",
                "minProperties": 1,
                "additionalProperties": False,
                "properties": {
                    "$eq": _FILTER_SCALAR,
                    "$ne": _FILTER_SCALAR,
                    "$in": {"type": "array", "items": _FILTER_SCALAR, "minItems": 1, "maxItems": MAX_FILTER_VALUES},
                    **{op: {"type": "number"} for op in ("$gt", "$gte", "$lt", "$lte")},
                },
            },
        ]
    },
}
"""What MetadataFilter.parse takes (ragkv.ingest.index.filters), as JSON Schema: a key names
metadata (not empty, not an operator), its value is a scalar or an operator object."""


class RetrievalOptions(StrictRequest):
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
    filter: Annotated[dict[str, Any], WithJsonSchema(FILTER_SCHEMA)] | None = Field(
        None,
        description='retrieve only from documents whose metadata matches: {"team": "legal"}, '
        '{"team": {"$in": ["legal", "hr"]}}, {"year": {"$gte": 2020}} ($gt, $gte, $lt, $lte, $ne); every key must hold',
    )

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        return known_spec(value, STRATEGY_NAMES, "fusion strategy")


class SparseOptions(StrictRequest):
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
        return known_spec(value, SELECTOR_NAMES, "selector")

    @property
    def wants_sparse(self) -> bool:
        return (
            self.selector.split(":", 1)[0] != "dense"
            or self.budget is not None
            or self.head_aggregation is not None
            or self.snapkv_capacity is not None
        )


class ChatRag(RetrievalOptions):
    enabled: StrictBool = Field(True, description="retrieve documents for this turn")
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN, description="the same as the top-level session_id")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = Field(False, description="send a last chunk with the token usage (and empty choices)")


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
    seed: Integer | None = seed_field("seed of the sampler (64 bits); greedy decoding ignores it")
    prompt_spans: StrictBool | None = Field(
        None,
        description="reuse the KV of passages pasted into the prompt from the chunk store, wherever "
        "they stand (new passages are stored for the next request); absent: the server's "
        "--prompt-spans setting",
    )
