"""Prometheus metrics, in a registry of the app's own (several apps may share a process).

Two sets side by side: vLLM's request and scheduler families under their `vllm:` names
(api.vllm_metrics; what existing dashboards read), and ragkv's own `ragkv_` families for
what vLLM has no name for (chunk hits, token reuse by kind, fusion, store tiers, sessions).
Request counts and latencies come from the middleware; TTFT, chunk hits and token reuse
from the query and chat paths; store and session figures are read at scrape time
(`scrape_readings`: every figure read when /metrics is scraped, in this one module).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ragkv.api.vllm_metrics import RequestRecord, VllmMetrics
from ragkv.app.chat.turn import ChatInfo
from ragkv.app.query import QueryInfo
from ragkv.app.request import Request, RequestOutput
from ragkv.app.server import RequestStream, ServerObserver, ServerStats, Task
from ragkv.app.usage import TokenUsage

if TYPE_CHECKING:  # the state holds the metrics: imported for annotations only
    from ragkv.api.state import AppState

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5, 8, 13, 20)
_KL_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3)
"""Nats, half a decade apart: a fusion close to the full prefill sits in the lowest ones."""


Reading = tuple[str, str, str, dict[str, str], "float | None"]
"""(kind 'gauge' or 'counter', name, help, labels, value) of one scrape-time sample."""


class _ScrapeTime(Collector):
    """Samples computed when /metrics is read (store, sessions, Redis health)."""

    def __init__(self, read: Callable[[], Iterable[Reading]]):
        self._read = read

    def collect(self):
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for kind, name, help_text, labels, value in self._read():
            if value is None:
                continue
            family = families.get(name)
            if family is None:
                family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = families[name] = family_type(name, help_text, labels=sorted(labels))
            family.add_metric([labels[key] for key in sorted(labels)], float(value))
        yield from families.values()


_COUNTERS = (  # (attribute, name, help, labels)
    ("requests", "ragkv_http_requests", "HTTP requests by route, method and status", ["route", "method", "status"]),
    ("chunks", "ragkv_chunk_lookups", "Retrieved chunks found in the store (hit) or recomputed (miss)", ["result"]),
    (
        "tokens",
        "ragkv_tokens",
        "Prompt tokens reused from stored/session KV vs recomputed, and completion tokens",
        ["kind"],
    ),
    ("jobs", "ragkv_worker_jobs", "Model worker jobs by kind and outcome", ["kind", "outcome"]),
    ("sessions_turns", "ragkv_chat_turns", "Chat turns by whether they continued a stored session", ["phase"]),
)
_HISTOGRAMS = (  # (attribute, name, help, labels, buckets)
    (
        "latency",
        "ragkv_http_request_seconds",
        "HTTP request latency (to the last byte for streams)",
        ["route", "method"],
        _LATENCY_BUCKETS,
    ),
    (
        "ttft",
        "ragkv_ttft_seconds",
        "Time to first token on the model worker (retrieve + load + fuse or prefill)",
        ["endpoint", "phase"],
        _TTFT_BUCKETS,
    ),
    (
        "queue_wait",
        "ragkv_queue_wait_seconds",
        "Time a request waited for the model worker",
        ["kind"],
        _LATENCY_BUCKETS,
    ),
    (
        "fusion_kl",
        "ragkv_fusion_first_token_kl",
        "KL(full prefill || fused) of the first token of sampled live requests, in nats "
        "(--fidelity-sample-rate; measured when the server is idle)",
        ["strategy"],
        _KL_BUCKETS,
    ),
)


class Metrics:
    def __init__(self, model_name: str = "ragkv") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.model_name = model_name
        """The `model_name` label of the vLLM families: the served model id (set at startup)."""
        self.vllm = VllmMetrics(r)
        self.requests: Counter
        self.chunks: Counter
        self.tokens: Counter
        self.jobs: Counter
        self.sessions_turns: Counter
        self.latency: Histogram
        self.ttft: Histogram
        self.queue_wait: Histogram
        self.fusion_kl: Histogram
        for attribute, name, help_text, labels in _COUNTERS:
            setattr(self, attribute, Counter(name, help_text, labels, registry=r))
        for attribute, name, help_text, labels, buckets in _HISTOGRAMS:
            setattr(self, attribute, Histogram(name, help_text, labels, buckets=buckets, registry=r))
        self.fidelity_dropped = Counter(
            "ragkv_fusion_fidelity_samples_dropped",
            "Fidelity samples given up (the queue of samples was full, or their full prefill failed)",
            registry=r,
        )
        self.queue_depth = Gauge("ragkv_worker_queue_depth", "Jobs waiting for the model worker", registry=r)
        self.active_jobs = Gauge("ragkv_worker_active_jobs", "Jobs the model worker is interleaving", registry=r)

    def add_scrape_time(self, read: Callable[[], Iterable[Reading]]) -> None:
        self.registry.register(_ScrapeTime(read))

    def record_usage(self, usage: TokenUsage, chunk_hits: int, chunk_misses: int) -> None:
        self.tokens.labels("reused").inc(usage.cached_tokens)
        self.tokens.labels("recomputed").inc(usage.recomputed_tokens)
        self.tokens.labels("completion").inc(usage.completion_tokens)
        if chunk_hits:
            self.chunks.labels("hit").inc(chunk_hits)
        if chunk_misses:
            self.chunks.labels("miss").inc(chunk_misses)

    def record_fidelity(self, strategy: str, kl: float) -> None:
        self.fusion_kl.labels(strategy).observe(kl)


class MetricsObserver(ServerObserver):
    """What the engine client reports, counted into the metrics."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def task_ended(self, task: Task) -> None:
        self.metrics.jobs.labels(task.kind, task.outcome or "unknown").inc()

    def stream_ended(self, stream: RequestStream) -> None:
        self.metrics.jobs.labels(stream.kind, stream.outcome or "unknown").inc()

    def fidelity_measured(self, strategy: str, kl: float) -> None:
        self.metrics.record_fidelity(strategy, kl)

    def fidelity_dropped(self) -> None:
        self.metrics.fidelity_dropped.inc()

    def request_finished(self, request: Request, output: RequestOutput) -> None:
        """vLLM's request metrics for every request; ragkv's own families describe retrieval
        and sessions, which a plain completion has none of."""
        metrics = self.metrics
        if request.kind == "query":
            info: QueryInfo = output.info
            self._record_latency("query", "fused", output)
            metrics.record_usage(output.usage, max(len(output.citations) - info.missing_chunks, 0), info.missing_chunks)
        elif request.kind == "chat":
            chat: ChatInfo = output.info
            phase = "next_turn" if chat.turn > 1 else "first_turn"
            self._record_latency("chat", phase, output)
            metrics.record_usage(output.usage, chat.new_chunks, 0)
            metrics.sessions_turns.labels(phase).inc()
        metrics.vllm.record_request(metrics.model_name, RequestRecord.of(request, output))

    def _record_latency(self, endpoint: str, phase: str, output: RequestOutput) -> None:
        self.metrics.ttft.labels(endpoint, phase).observe(output.timings.ttft)
        self.metrics.queue_wait.labels(endpoint).observe(output.timings.queue)


# -- read at scrape time ---------------------------------------------------------------------

_STORE_TIER = (  # (kind, name, help, the tier's field)
    ("gauge", "ragkv_store_entries", "Chunks held by each store tier", "entries"),
    ("gauge", "ragkv_store_bytes", "Bytes held by each store tier", "bytes"),
    ("counter", "ragkv_store_hits", "Chunk lookups each tier answered", "hits"),
    ("counter", "ragkv_store_misses", "Chunk lookups each tier missed", "misses"),
    ("counter", "ragkv_store_corrupt", "Blobs each tier found corrupt (dropped, recomputed)", "corrupt"),
    ("counter", "ragkv_store_errors", "Backend operations that failed and were absorbed (Redis down)", "errors"),
    (
        "counter",
        "ragkv_store_evictions",
        "Chunks evicted to stay within --store-capacity (each recomputed on its next use)",
        "evictions",
    ),
    ("gauge", "ragkv_store_capacity_bytes", "The --store-capacity bound of each tier", "capacity_bytes"),
    (
        "gauge",
        "ragkv_store_protected_bytes",
        "Bytes of chunks read since they were written, evicted last (a capped LMDB tier)",
        "protected_bytes",
    ),
)
_STORE_TENANT = (  # (kind, name, help, the tenant's field); tenant "" is chunks shared across tenants
    ("gauge", "ragkv_store_tenant_bytes", "Bytes of chunk KV each tenant holds in the store", "bytes"),
    ("counter", "ragkv_store_tenant_hits", "Chunk lookups of each tenant the store answered", "hits"),
    ("counter", "ragkv_store_tenant_misses", "Chunk lookups of each tenant the store missed", "misses"),
    (
        "counter",
        "ragkv_store_tenant_evictions",
        "Chunks of each tenant evicted, past its budget or its fair share of --store-capacity",
        "evictions",
    ),
)
_PROMPT_SPANS = (  # (name, help): ragkv_prompt_span_<name>, a field of the passage counters
    ("hits", "Passages found in prompts whose KV the store held"),
    ("misses", "Passages found in prompts computed for the request (then stored)"),
    ("tokens_reused", "Prompt tokens of passages whose KV came from the store"),
    ("tokens_stored", "Prompt tokens of new passages whose KV was stored"),
)
_SESSIONS = {  # the sessions' stats key: (kind, name, help)
    "sessions": ("gauge", "ragkv_sessions", "Chat sessions in this process's memory"),
    "bytes": ("gauge", "ragkv_session_bytes", "Bytes of session KV in this process's memory"),
    "evicted": ("counter", "ragkv_sessions_evicted", "Sessions dropped from memory for space"),
    "anonymous": ("gauge", "ragkv_anonymous_contexts", "Cached contexts of turns without a session id"),
    "anonymous_bytes": (
        "gauge",
        "ragkv_anonymous_context_bytes",
        "Bytes of anonymous context KV in this process's memory",
    ),
}
_SHARED_CONTEXTS = (  # (name, help): ragkv_shared_context_<name>
    ("published", "Anonymous contexts published to Redis for other replicas"),
    ("dropped", "Anonymous-context snapshots not published (queue full or Redis failed)"),
    ("hits", "Turns that continued a context another replica published"),
    ("hit_tokens", "Conversation tokens reused from contexts other replicas published"),
    ("loaded", "Turns that continued, by the id its answer named, a context another replica published"),
    ("publish_seconds", "Seconds from a context's snapshot to its publication, summed"),
)
_REDIS_UP = "1 if Redis answers PING"
_PIECES = "Steps that ran a piece of a prefill or recompute cut by --max-num-batched-tokens while answers decoded"


def scrape_readings(state: AppState) -> Iterator[Reading]:
    """Every figure read when /metrics is scraped (the rest is counted as requests run):
    the store's tiers, pasted passages, sessions, Redis health, ingestion jobs, the worker."""
    stats = state.client.stats()
    yield from _store_readings(stats)
    if stats.store_redis_up is not None:
        yield "gauge", "ragkv_redis_up", _REDIS_UP, {"role": "chunks"}, float(stats.store_redis_up)
    sessions = stats.sessions
    yield from _session_readings(stats)
    if stats.registry_up is not None:
        yield "gauge", "ragkv_redis_up", _REDIS_UP, {"role": "registry"}, float(stats.registry_up)
    degraded = stats.store_redis_up is False or sessions.get("redis_up") is False or stats.registry_up is False
    yield "gauge", "ragkv_degraded", "1 while a fallback is in use (Redis unreachable)", {}, float(bool(degraded))
    for status, count in stats.ingest_jobs.items():
        yield "gauge", "ragkv_ingest_jobs", "Ingestion jobs by status", {"status": status}, count
    state.metrics.queue_depth.set(stats.worker.queued)
    state.metrics.active_jobs.set(stats.worker.active)
    if stats.scheduler is not None:
        state.metrics.vllm.set_scheduler(state.model_id, stats.scheduler)
        yield "counter", "ragkv_prefill_pieces", _PIECES, {}, float(stats.scheduler.prefill_pieces)


def _store_readings(stats: ServerStats) -> Iterator[Reading]:
    store = stats.store
    for index, tier in enumerate(list(store.tiers) or [store]):
        labels = {"tier": f"{index}:{tier.backend}"}
        for kind, name, help_text, field in _STORE_TIER:
            yield kind, name, help_text, labels, getattr(tier, field)
    for tenant in store.tenants:
        for kind, name, help_text, field in _STORE_TENANT:
            if getattr(tenant, field) is not None:
                yield kind, name, help_text, {"tenant": tenant.tenant}, getattr(tenant, field)
    if store.lru is not None:
        yield "gauge", "ragkv_store_lru_bytes", "Bytes in the in-process chunk LRU", {}, store.lru.bytes
    for name, help_text in _PROMPT_SPANS:
        yield "counter", f"ragkv_prompt_span_{name}", help_text, {}, getattr(stats.prompt_spans, name)


def _session_readings(stats: ServerStats) -> Iterator[Reading]:
    sessions = stats.sessions
    if stats.backends.sessions == "redis":
        yield "gauge", "ragkv_redis_up", _REDIS_UP, {"role": "sessions"}, float(sessions["redis_up"])
    for key, (kind, name, help_text) in _SESSIONS.items():
        yield kind, name, help_text, {}, sessions[key]
    shared = sessions.get("shared_contexts")
    if shared is not None:
        for name, help_text in _SHARED_CONTEXTS:
            yield "counter", f"ragkv_shared_context_{name}", help_text, {}, shared[name]
