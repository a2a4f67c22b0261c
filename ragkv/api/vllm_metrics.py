"""vLLM's request and scheduler metrics, under vLLM's own names (`vllm:...`), so the
dashboards and alerts operators already run against vLLM work on ragkv unchanged.

Names, types, labels (`model_name`, `engine`) and meanings follow vLLM's v1 Prometheus
logger (vllm/v1/metrics/loggers.py); only the histogram buckets differ: they are spread
over CPU latencies (a first token in tens of milliseconds to a minute, a decode step of a
few milliseconds to a second) instead of GPU ones.

Per request, from its own timestamps (all from the request's arrival at the scheduler):
  time_to_first_token_seconds     arrival -> first token
  inter_token_latency_seconds     one observation per gap between two sampled tokens
  e2e_request_latency_seconds     arrival -> finished
  request_queue_time_seconds      arrival -> its prepare starts (WAITING)
  request_prefill_time_seconds    prepare starts -> first token (retrieve, load, fuse or prefill)
  request_decode_time_seconds     first token -> finished
  request_inference_time_seconds  prepare starts -> finished (RUNNING)
Counters are in tokens: `prompt_tokens` counts every prompt row, `prefix_cache_queries`
the prompt rows looked up and `prefix_cache_hits` those whose KV was reused (stored chunk
KV, a cached prefix or context), so hits / queries is the prompt reuse ratio.
Requests that are cancelled or fail are counted in none of these (as in vLLM, whose
`request_success` counts finished requests only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ragkv.api.common.serving import openai_finish_reason
from ragkv.app.request import Request, RequestOutput
from ragkv.app.server import SchedulerLoad

LABELS = ["model_name", "engine"]
ENGINE = "0"
"""ragkv runs one engine per process; vLLM labels each of its data-parallel engines."""

TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (
    0.05,
    0.1,
    0.2,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass(frozen=True)
class RequestRecord:
    """What one finished request reports (seconds from its arrival; tokens)."""

    queue_s: float
    ttft_s: float
    e2e_s: float
    token_times_s: tuple[float, ...]
    """When each token was sampled (the end-of-sequence token too, as vLLM counts it)."""
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    max_tokens: int
    finished_reason: str
    """vLLM's reasons: 'stop' (end of sequence or a stop string) or 'length'."""

    @classmethod
    def of(cls, request: Request, completion: RequestOutput, finished: float | None = None) -> RequestRecord:
        """The record of a request that just finished (called from its on_finished hook)."""
        finished = time.perf_counter() if finished is None else finished
        timings = completion.timings
        queue = timings.queue or 0.0
        return cls(
            queue_s=queue,
            ttft_s=timings.ttft if timings.ttft is not None else queue,
            e2e_s=finished - request.arrival,
            token_times_s=tuple(request.token_times),
            prompt_tokens=completion.usage.prompt_tokens,
            cached_tokens=completion.usage.cached_tokens,
            generation_tokens=completion.usage.completion_tokens,
            max_tokens=request.generation.max_new_tokens,
            finished_reason=openai_finish_reason(completion.finish_reason),
        )


_HISTOGRAMS = (  # (attribute, vLLM's name, its help, buckets)
    ("request_prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS),
    (
        "request_generation_tokens",
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        TOKEN_BUCKETS,
    ),
    (
        "request_max_tokens",
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        TOKEN_BUCKETS,
    ),
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    ("tpot", "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", ITL_BUCKETS),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS),
    (
        "queue_time",
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_BUCKETS,
    ),
    (
        "inference_time",
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        REQUEST_BUCKETS,
    ),
    (
        "prefill_time",
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        REQUEST_BUCKETS,
    ),
    (
        "decode_time",
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_BUCKETS,
    ),
)


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry

        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram(name, help_text, LABELS, buckets=buckets, registry=r)

        self.request_prompt_tokens: Histogram
        self.request_generation_tokens: Histogram
        self.request_max_tokens: Histogram
        self.ttft: Histogram
        self.itl: Histogram
        self.tpot: Histogram
        self.e2e: Histogram
        self.queue_time: Histogram
        self.inference_time: Histogram
        self.prefill_time: Histogram
        self.decode_time: Histogram
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", LABELS, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS, registry=r
        )
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", LABELS, registry=r
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            LABELS,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", LABELS, registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            LABELS + ["finished_reason"],
            registry=r,
        )
        for attribute, name, help_text, buckets in _HISTOGRAMS:
            setattr(self, attribute, histogram(name, help_text, buckets))

    def declare(self, model_name: str) -> None:
        """Export every family for `model_name` at zero before the first request, as vLLM does,
        so dashboards and alerts see the series (not "no data") from the start."""
        labels = (model_name, ENGINE)
        for family in vars(self).values():
            if family is self.request_success:
                for reason in ("stop", "length"):
                    family.labels(*labels, reason)
            elif isinstance(family, (Counter, Gauge, Histogram)):
                family.labels(*labels)

    def record_request(self, model_name: str, record: RequestRecord) -> None:
        labels = (model_name, ENGINE)
        self.prompt_tokens.labels(*labels).inc(record.prompt_tokens)
        self.generation_tokens.labels(*labels).inc(record.generation_tokens)
        self.prefix_cache_queries.labels(*labels).inc(record.prompt_tokens)
        self.prefix_cache_hits.labels(*labels).inc(record.cached_tokens)
        self.request_success.labels(*labels, record.finished_reason).inc()
        self.request_prompt_tokens.labels(*labels).observe(record.prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(record.generation_tokens)
        self.request_max_tokens.labels(*labels).observe(record.max_tokens)
        self.ttft.labels(*labels).observe(record.ttft_s)
        itl = self.itl.labels(*labels)
        times = record.token_times_s
        for earlier, later in zip(times, times[1:]):
            itl.observe(later - earlier)
        if len(times) > 1:  # vLLM: the mean gap of the request, observed once per request
            self.tpot.labels(*labels).observe((times[-1] - times[0]) / (len(times) - 1))
        self.e2e.labels(*labels).observe(record.e2e_s)
        self.queue_time.labels(*labels).observe(record.queue_s)
        self.prefill_time.labels(*labels).observe(max(record.ttft_s - record.queue_s, 0.0))
        self.decode_time.labels(*labels).observe(max(record.e2e_s - record.ttft_s, 0.0))
        self.inference_time.labels(*labels).observe(max(record.e2e_s - record.queue_s, 0.0))

    def set_scheduler(self, model_name: str, reading: SchedulerLoad) -> None:
        labels = (model_name, ENGINE)
        self.running.labels(*labels).set(reading.running)
        self.waiting.labels(*labels).set(reading.waiting)
        self.kv_cache_usage.labels(*labels).set(reading.kv_cache_usage)
