"""Two tenants on one capped store: `ragkv bench tenants`.

A real `ragkv serve` per configuration (B's mode x budgets on or off), each on a fresh
store capped at `--store-capacity`, with an API keys file naming tenants A and B (with
budgets, each key's `store_budget_bytes`). In each: A pastes its whole pool once, asks
its questions alone, then as many again while B sends `b_rate` requests to each of A's
(tenants_workload): both phases find A's pool stored and differ only by B. Requests go
one at a time, B's between A's: A's TTFT then measures what the store gives it, not two
prefills sharing the cores. Figures per run:
A's hit rate and TTFT p50 over its last questions, alone and beside B, their change and
ratio, B's requests and each tenant's evictions and bytes from /metrics. With no capacity
given, one uncapped start of A alone measures A's stored bytes, and the cap is
`capacity_pools` times that.
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from ragkv.bench.tenants_workload import Answer, Prompt, TenantsConfig, Traffic, hit_rate, ratio, ttft_p50

KEYS = {"A": "tenant-a-bench-key", "B": "tenant-b-bench-key"}
HIT_RATE_GOAL = 0.05
"""The issue's goals: A's hit rate beside B within this of A alone, ..."""
TTFT_GOAL = 1.2
"""... and its TTFT p50 within this ratio."""
COLD_GOAL = 1.1
"""A cold prompt into the store at its cap: TTFT p50 within this ratio of one into the empty store."""


@dataclass
class PhaseFigures:
    a_requests: int
    a_errors: int
    b_requests: int
    b_errors: int
    a_hit_rate_last: float | None
    a_hit_rate_all: float | None
    a_ttft_p50_last_s: float | None
    a_ttft_p50_all_s: float | None
    b_hit_rate: float | None
    wall_s: float
    evictions: dict[str, float] = field(default_factory=dict)
    """Chunks of each tenant evicted during the phase (ragkv_store_tenant_evictions)."""
    tenant_bytes: dict[str, float] = field(default_factory=dict)
    """Each tenant's bytes in the store at the phase's end (ragkv_store_tenant_bytes)."""


@dataclass
class RunFigures:
    mode: str
    budgets: bool
    capacity_bytes: int
    budget_bytes: int | None
    alone: PhaseFigures
    beside_b: PhaseFigures
    hit_rate_change: float | None
    """A's hit rate over its last questions beside B less alone."""
    ttft_ratio: float | None
    meets_goals: bool | None
    cold_ttft_p50_empty_s: float | None = None
    """Cold prompts (new passages) sent into the empty store, after the warm-up ..."""
    cold_ttft_p50_at_cap_s: float | None = None
    """... and as many into the store at its cap, after A beside B."""
    cold_ratio: float | None = None
    cold_meets_goal: bool | None = None
    store_bytes_at_cap: float | None = None
    """Every tenant's bytes when the cold prompts at the cap are sent."""


@dataclass
class TenantsResult:
    config: dict
    capacity_bytes: int = 0
    uncapped_alone: PhaseFigures | None = None
    runs: list[RunFigures] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def phase_figures(answers: list[Answer], last: int, wall_s: float, before: dict, after: dict) -> PhaseFigures:
    """A phase's figures from its answers and two /metrics readings (tenant_readings)."""
    a = [x for x in answers if x.tenant == "A"]
    b = [x for x in answers if x.tenant == "B"]
    done = [x for x in a if x.ok]
    evicted = {t: after["evictions"].get(t, 0) - before["evictions"].get(t, 0) for t in after["evictions"]}
    return PhaseFigures(
        a_requests=len(a),
        a_errors=len(a) - len(done),
        b_requests=len(b),
        b_errors=sum(not x.ok for x in b),
        a_hit_rate_last=hit_rate(done[-last:]),
        a_hit_rate_all=hit_rate(done),
        a_ttft_p50_last_s=ttft_p50(done[-last:]),
        a_ttft_p50_all_s=ttft_p50(done),
        b_hit_rate=hit_rate(b),
        wall_s=round(wall_s, 2),
        evictions=evicted,
        tenant_bytes=dict(after["bytes"]),
    )


@dataclass
class ServerFigures:
    """What one server's run measured (beside_b and cold_at_cap only with a mode)."""

    alone: PhaseFigures
    beside_b: PhaseFigures | None = None
    cold_empty: list[Answer] = field(default_factory=list)
    cold_at_cap: list[Answer] = field(default_factory=list)


def run_figures(mode: str, budgets: bool, capacity: int, budget: int | None, server: ServerFigures) -> RunFigures:
    alone, beside = server.alone, server.beside_b
    change = None
    if alone.a_hit_rate_last is not None and beside.a_hit_rate_last is not None:
        change = round(beside.a_hit_rate_last - alone.a_hit_rate_last, 4)
    slower = ratio(beside.a_ttft_p50_last_s, alone.a_ttft_p50_last_s)
    goals = None if change is None or slower is None else abs(change) <= HIT_RATE_GOAL and slower <= TTFT_GOAL
    empty, at_cap = ttft_p50(server.cold_empty), ttft_p50(server.cold_at_cap)
    cold = ratio(at_cap, empty)
    return RunFigures(
        mode,
        budgets,
        capacity,
        budget,
        alone,
        beside,
        change,
        slower,
        goals,
        cold_ttft_p50_empty_s=empty,
        cold_ttft_p50_at_cap_s=at_cap,
        cold_ratio=cold,
        cold_meets_goal=None if cold is None else cold <= COLD_GOAL,
        store_bytes_at_cap=sum(beside.tenant_bytes.values()) if beside else None,
    )


def tenant_readings(text: str) -> dict:
    """{"bytes": {tenant: value}, "evictions": {tenant: value}} from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    readings: dict = {"bytes": {}, "evictions": {}}
    wanted = {"ragkv_store_tenant_bytes": "bytes", "ragkv_store_tenant_evictions_total": "evictions"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and "tenant" in sample.labels:
                readings[wanted[sample.name]][sample.labels["tenant"]] = sample.value
    return readings


def ask(http: httpx.Client, prompt: Prompt) -> Answer:
    """One streamed answer: its time to first token and its usage."""
    started, first, usage = time.perf_counter(), None, None
    headers = {"Authorization": f"Bearer {KEYS[prompt.tenant]}"}
    try:
        with http.stream("POST", "/v1/chat/completions", json=prompt.body, headers=headers) as response:
            if response.status_code != 200:
                response.read()
                return Answer(prompt.tenant, ok=False)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                if first is None and any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                    first = time.perf_counter()
    except httpx.TransportError:
        return Answer(prompt.tenant, ok=False)
    if first is None or usage is None:
        return Answer(prompt.tenant, ok=False)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Answer(prompt.tenant, True, first - started, usage["prompt_tokens"], cached, prompt.reusable_tokens)


def run_phase(url: str, prompts: list[Prompt], last: int) -> PhaseFigures:
    with httpx.Client(base_url=url, timeout=1800) as http:
        before = tenant_readings(http.get("/metrics").text)
        started = time.perf_counter()
        answers = [ask(http, prompt) for prompt in prompts]
        wall = time.perf_counter() - started
        after = tenant_readings(http.get("/metrics").text)
    return phase_figures(answers, last, wall, before, after)


def keys_file(path: Path, budget: int | None) -> Path:
    entries = {key: {"tenant": tenant} for tenant, key in KEYS.items()}
    if budget is not None:
        for entry in entries.values():
            entry["store_budget_bytes"] = budget
    path.write_text(json.dumps(entries))
    return path


def serve(config: TenantsConfig, folder: Path, capacity: int | None, budget: int | None):
    """A started `ragkv serve` on a fresh store in `folder` (anonymous contexts kept in 1 KiB, so none: A's
    cached tokens are then the store's alone)."""
    from ragkv.api.launcher import ServerProcess

    options = ["--data-dir", str(folder), "--api-keys", str(keys_file(folder / "keys.json", budget))]
    options += ["--anonymous-memory-mb", "0.001", "--log-level", "warning"]
    options += ["--store-capacity", str(capacity)] if capacity is not None else []
    options += ["--model", config.model] if config.model else []
    return ServerProcess([*options, *config.serve_options], log_path=folder / "serve.log").start(timeout_s=900)


def _tokens_counter(config: TenantsConfig) -> Callable[[str], int]:
    from transformers import AutoTokenizer

    from ragkv.engine.model_files import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(config.model))
    return functools.cache(lambda text: len(tokenizer.encode(text, add_special_tokens=False)))


def _one_server(config: TenantsConfig, traffic: Traffic, capacity: int | None, budget: int | None, mode):
    """A fresh server: cold prompts into the empty store, A's pool stored, A alone, then
    (with a mode) A beside B and cold prompts into the store at its cap. The first request
    is B's, on a passage no phase pastes, so start-up costs fall on no figure."""
    with tempfile.TemporaryDirectory(prefix="ragkv-tenants-") as scratch:
        server = serve(config, Path(scratch), capacity, budget)
        try:
            traffic.restart()
            with httpx.Client(base_url=server.url, timeout=1800) as http:
                ask(http, traffic.warm_up())
                cold_empty = [ask(http, prompt) for prompt in traffic.cold_prompts(at_capacity=False)]
                for prompt in traffic.a_pool_prompts():
                    ask(http, prompt)
            figures = ServerFigures(run_phase(server.url, traffic.phase(None), config.last), cold_empty=cold_empty)
            if mode:
                figures.beside_b = run_phase(server.url, traffic.phase(mode), config.last)
                with httpx.Client(base_url=server.url, timeout=1800) as http:
                    figures.cold_at_cap = [ask(http, prompt) for prompt in traffic.cold_prompts(at_capacity=True)]
        finally:
            server.stop()
    return figures


def run_tenants(config: TenantsConfig, examples, progress: Callable[[str], None]) -> TenantsResult:
    traffic = Traffic(config, examples, _tokens_counter(config))
    result = TenantsResult(config={**asdict(config), "dataset": str(config.dataset)})
    if config.capacity_mb is None:
        progress("uncapped store: A alone, to size the cap by A's stored bytes ...")
        result.uncapped_alone = _one_server(config, traffic, None, None, None).alone
        a_bytes = result.uncapped_alone.tenant_bytes.get("A", 0)
        if not a_bytes:
            raise RuntimeError("A's questions stored nothing: no cap can be sized from them")
        progress(json.dumps(asdict(result.uncapped_alone)))
        result.capacity_bytes = int(config.capacity_pools * a_bytes)
    else:
        result.capacity_bytes = int(config.capacity_mb * 2**20)
    for budgets in config.budgets:
        budget = int(config.budget_share * result.capacity_bytes) if budgets else None
        for mode in config.modes:
            progress(f"{mode}, budgets {'on' if budgets else 'off'}: cap {result.capacity_bytes} bytes ...")
            run = run_figures(
                mode,
                budgets,
                result.capacity_bytes,
                budget,
                _one_server(config, traffic, result.capacity_bytes, budget, mode),
            )
            progress(
                f"  A hit rate last {config.last}: alone {run.alone.a_hit_rate_last}, beside B "
                f"{run.beside_b.a_hit_rate_last} (change {run.hit_rate_change}); TTFT p50 ratio {run.ttft_ratio}; "
                f"evictions {run.beside_b.evictions}; cold TTFT p50 empty {run.cold_ttft_p50_empty_s} s, at cap "
                f"{run.cold_ttft_p50_at_cap_s} s (ratio {run.cold_ratio})"
            )
            result.runs.append(run)
    return result
