"""Prometheus metrics, in a registry of the app's own (several apps may share a process).

Two sets side by side: vLLM's request and scheduler families under their `vllm:` names
(api.vllm_metrics; what existing dashboards read), and ragkv's own `ragkv_` families for
what vLLM has no name for (chunk hits, token reuse by kind, fusion, store tiers, sessions).
Request counts and latencies come from the middleware; TTFT, chunk hits and token reuse
from the query and chat paths; store and session figures are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ragkv.api.vllm_metrics import VllmMetrics
from ragkv.app.usage import TokenUsage

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
