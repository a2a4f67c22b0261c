"""Typed configuration of the engine client: the runtime, the scheduler's bounds, the
sessions and live fidelity. The HTTP server's config extends it (api.config.ServeConfig)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ragkv.app.runtime import RuntimeConfig
from ragkv.app.server.prefetch import DEFAULT_PREFETCH_MB

CONTEXT_MEMORY_SHARE = 64
"""Each in-process context budget defaults to this fraction (1/64) of the machine's memory..."""
CONTEXT_MEMORY_MB = (64.0, 256.0)
"""...kept within these MiB: 256 MiB holds ~11K tokens of the packaged model's bfloat16 KV
(23,040 bytes a token: 30 layers x 3 KV heads x 64 x K and V x 2 bytes), one long
conversation with its room to grow."""
MIB = 1 << 20


def machine_memory_bytes() -> int:
    """Physical memory, or the container's cgroup limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(limit).read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            total = min(total, int(value))
    return total


def default_context_memory_mb() -> float:
    """The default of each in-process context budget (sessions, anonymous contexts): 1/64 of
    the machine's memory, at least 64 and at most 256 MiB, so a soak's resident memory
    levels off instead of growing toward budgets larger than the run ever fills."""
    low, high = CONTEXT_MEMORY_MB
    return float(min(max(machine_memory_bytes() / CONTEXT_MEMORY_SHARE / MIB, low), high))


@dataclass(frozen=True)
class ServerConfig:
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    model_id: str | None = None
    """Model name served on /v1/models; None = the model folder's name."""
    session_store: str | None = None
    """redis://HOST:PORT/DB for shared chat sessions; None = the Redis of --store when it
    has one, else sessions live only in this process's memory. "memory" forces memory."""
    session_ttl_s: float = 1800.0
    """Idle seconds after which a chat session expires."""
    session_memory_mb: float = field(default_factory=default_context_memory_mb)
    """MiB of session KV kept in process memory (least recently used are dropped). Default:
    1/64 of the machine's memory (its cgroup limit when lower) within 64-256 MiB. A context
    costs its KV rows: 23,040 bytes a token for the packaged model in bfloat16 (a 6K-token
    conversation with documents ~140 MiB, ~280 MiB in float32); a context larger than the
    budget is not kept."""
    anonymous_memory_mb: float = field(default_factory=default_context_memory_mb)
    """MiB of KV of anonymous contexts (turns without a session id, found again by prefix or
    by the id their answer named) in process memory, a budget apart from the sessions'.
    Default: as session_memory_mb."""
    shared_context_mb: float = 1024.0
    """With a Redis session store: MiB of anonymous-context KV each tenant may keep there
    (16-bit, least recently used dropped), so a follow-up resent whole to another replica
    finds its cached prefix; 0 keeps anonymous contexts in process memory only."""
    shared_context_codes: str = "16bit"
    """How published anonymous contexts travel through Redis: 16bit (the cache's dtype;
    float16 for a float32 cache) or int8 (8-bit codes as chunk blobs can be: about half the
    bytes, so half the fetch). Named sessions always travel in 16 bits."""
    shared_publish_wait_s: float = 10.0
    """With anonymous contexts published (a Redis session store, shared_context_mb > 0):
    seconds at most a chat answer's last event waits for its context to reach Redis, so a
    follow-up sent the moment the answer ends, to any replica, finds it by prefix or by the
    answer's id. Past it the answer ends anyway, with session.shared false. 0 = no wait."""
    session_lock_ttl_s: float = 10.0
    """Seconds a session's Redis lock outlives a process that died mid-turn (renewed while
    the turn runs)."""
    max_input_tokens: int | None = None
    """Largest question / chat message / prompt, in tokens; None = what the model's context
    takes (with room for the answer), so a pasted RAG prompt that fits the model is taken."""
    max_active: int = 16
    """Requests decoding at once: each decode step is one batched forward pass over all of
    them; more wait in the queue."""
    token_budget: int = 65536
    """KV rows (prompt + answer) the running requests may hold together; a waiting request
    is prepared only when its estimate fits."""
    max_num_batched_tokens: int = 512
    """Tokens one scheduler step computes (vLLM's name): while answers are decoding, a
    prompt's prefill, the text before its passages and a fusion's recompute run in pieces
    of at most this less the step's decode rows (a token late in a long prompt counted as
    the work its attention adds there: ragkv.engine.pass_cost), one piece per step beside the decodes, so
    answers being streamed go on while a long prompt is prepared (with none decoding, the
    preparation runs whole). 0 = each preparation whole in one step. The default is the
    measured one (BENCHMARKS.md, arrivals)."""
    max_queued: int = 64
    """Requests waiting in the scheduler (and, in a queue of their own, deletions, embeddings
    and ingestions waiting for the model worker); beyond this the API answers 503."""
    prefetch_mb: float = DEFAULT_PREFETCH_MB
    """MiB of stored K/V that waiting requests' fetches (retrieval, store reads, span
    look-ups: app.server.prefetch) may hold ahead of the model thread; a fetch starts while
    the requests fetched and not yet prepared hold less."""
    fidelity_sample_rate: float = 0.0
    """Share of fused requests whose first token is compared, when the server is idle, with a
    full prefill of the same prompt (histogram ragkv_fusion_first_token_kl); never delays a
    waiting request by more than one piece of that prefill. 0 = off."""

    def with_store_budgets(self, budgets: dict[str, int]) -> ServerConfig:
        """This config, its store keeping `budgets` (tenant -> bytes; the API keys file's)
        beside the default budget (ValueError where the store cannot keep them)."""
        if not budgets:
            return self
        return replace(self, runtime=replace(self.runtime, store_tenant_budgets=tuple(sorted(budgets.items()))))

    def __post_init__(self) -> None:
        for name in ("session_ttl_s", "session_memory_mb", "anonymous_memory_mb", "session_lock_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_input_tokens", "max_active", "max_queued", "token_budget"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.prefetch_mb <= 0:
            raise ValueError(f"prefetch_mb must be positive, got {self.prefetch_mb}")
        if self.max_num_batched_tokens < 0:
            raise ValueError("max_num_batched_tokens must be >= 0 (0 = whole prefills)")
        if not 0.0 <= self.fidelity_sample_rate <= 1.0:
            raise ValueError(f"fidelity_sample_rate must be in [0, 1], got {self.fidelity_sample_rate}")
        if self.shared_context_mb < 0 or self.shared_publish_wait_s < 0:
            raise ValueError("shared_context_mb and shared_publish_wait_s must be >= 0")
        if self.shared_context_codes not in ("16bit", "int8"):
            raise ValueError(f"shared_context_codes must be 16bit or int8, got {self.shared_context_codes!r}")
        if self.session_store not in (None, "memory") and not self.session_store.startswith(
            ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")
        ):
            raise ValueError("session_store must be 'memory', a redis:// or a redis+cluster:// URL")
