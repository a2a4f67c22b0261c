"""Typed configuration of the API server; `ragkv serve` fills it from its options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ragkv.api.rate_limits import KeyLimits
from ragkv.app.request_types import DEFAULT_RETRIEVAL, RETRIEVAL_MODES
from ragkv.app.server import ServerConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class ServeConfig(ServerConfig):
    """The engine client's fields (ServerConfig: runtime, scheduler bounds, sessions, live
    fidelity) and the HTTP server's."""

    host: str = DEFAULT_HOST
    """Address uvicorn binds (0.0.0.0 inside a container)."""
    port: int = DEFAULT_PORT
    """TCP port uvicorn listens on."""
    api_keys_file: Path | None = None
    """JSON file mapping API key -> tenant; also $RAGKV_API_KEYS ("key:tenant,key:tenant").
    Without keys every request is tenant "default" and no Authorization is needed."""
    max_requests_per_second: float = 0.0
    """Requests each API key may start per second, 429 with Retry-After past it (0: unlimited;
    a key's entry in the keys file may set its own)."""
    max_concurrent_requests: int = 0
    """Requests each API key may have in progress at once, 429 past it (0: unlimited; a key's
    entry in the keys file may set its own)."""
    rate_limit_storage: str = "memory://"
    """Where request rates are counted: memory:// (this process) or redis://host:port/db
    (shared by the replicas that name the same Redis)."""
    max_document_body_mb: float = 20.0
    """Largest request body on /v1/documents (413 above)."""
    max_body_kb: float = 1024.0
    """Largest request body on every other route (413 above)."""
    max_new_tokens: int = 1024
    """Largest max_tokens a request may ask for."""
    prompt_spans: bool = True
    """Find passages pasted into chat, completion and responses prompts and reuse their KV
    from the chunk store wherever they stand (stored under the tenant's salt, counted
    against --store-capacity); a request's `prompt_spans` field overrides it."""
    max_top_k: int = 16
    """Largest top_k a request may ask for (16 x 512-token chunks fill 8k positions)."""
    retrieval: str = DEFAULT_RETRIEVAL
    """Retrieval of requests that name none: dense, bm25 or hybrid (dense and BM25 fused)."""
    background_ingest_bytes: int = 32_768
    """Documents larger than this ingest as a background job (202 + /v1/jobs/{id})."""
    access_log: bool = True
    """Log one line per request (method, path, status, latency, request id, tenant) on the
    ragkv.access logger, whatever --log-level is."""
    log_format: str = "text"
    """text, or json: one JSON object per line (access-log fields as keys)."""

    @property
    def key_limits(self) -> KeyLimits:
        """Every API key's limits unless its keys-file entry sets its own."""
        return KeyLimits(self.max_requests_per_second, self.max_concurrent_requests)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_document_body_mb", "max_body_kb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_new_tokens", "max_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        KeyLimits(self.max_requests_per_second, self.max_concurrent_requests)  # ValueError when out of range
        if self.background_ingest_bytes < 0:
            raise ValueError("background_ingest_bytes must be >= 0")
        if self.retrieval not in RETRIEVAL_MODES:
            raise ValueError(f"retrieval must be one of {', '.join(RETRIEVAL_MODES)}, got {self.retrieval!r}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be 'text' or 'json', got {self.log_format!r}")
