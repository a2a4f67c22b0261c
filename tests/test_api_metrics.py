"""/metrics against a live `ragkv serve`: vLLM's families under vLLM's names, with values that
agree with what the requests reported, and every metric the Grafana dashboard in
deploy/grafana queries actually exported."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragkv.api.launcher import ServerProcess

pytestmark = [pytest.mark.model, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "ragkv-dashboard.json"
CORPUS = ROOT / "examples" / "corpus"
_METRIC_NAME = re.compile(r"\b((?:vllm:|ragkv_)[a-zA-Z0-9_:]+)")


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [
        variable["query"]["query"]
        for variable in dashboard["templating"]["list"]
        if isinstance(variable.get("query"), dict)
    ]
    assert exprs
    return {name for expr in exprs for name in _METRIC_NAME.findall(expr)}


def scrape(http: httpx.Client) -> dict[str, list]:
    """Sample name -> [(labels, value)] of one /metrics read."""
    response = http.get("/metrics")
    assert response.status_code == 200
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict, name: str, **labels) -> float:
    matching = [
        v for sample_labels, v in samples.get(name, []) if all(sample_labels.get(k) == w for k, w in labels.items())
    ]
    assert matching, f"{name} {labels} is not exported"
    return sum(matching)


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis_url):
    root = tmp_path_factory.mktemp("metrics")
    data = root / "data"
    args = ["--data-dir", str(data), "--store", f"tiered+lmdb://{data}/db?redis={redis_url}", "--log-level", "warning"]
    process = ServerProcess(args, log_path=root / "serve.log").start(timeout_s=600)  # a loaded CI machine is slow
    try:
        with httpx.Client(base_url=process.url, timeout=300) as http:
            path = sorted(CORPUS.iterdir())[0]
            response = http.post("/v1/documents", json={"text": path.read_text(), "name": path.name})
            assert response.status_code == 201, response.text
            yield http
    finally:
        process.stop()


def test_vllm_families_agree_with_the_requests_and_the_dashboard_names_are_exported(server):
    http = server
    model = http.get("/v1/models").json()["data"][0]["id"]
    before = scrape(http)
    for family in ("vllm:time_to_first_token_seconds_count", "vllm:prompt_tokens_total", "vllm:num_requests_running"):
        assert family in before  # declared at startup, before any request
    usages = []
    chat = {
        "model": "ragkv",
        "messages": [{"role": "user", "content": "What is this document about?"}],
        "max_tokens": 12,
        "rag": {"enabled": True, "top_k": 2},
    }
    for _ in range(2):  # the second turn resends the same prompt: its prefix is cached
        response = http.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
    response = http.post("/v1/query", json={"question": "What is this document about?", "max_tokens": 8})
    assert response.status_code == 200, response.text
    usages.append(response.json()["usage"])
    # A plain completion runs on the scheduler too, and is counted like the others.
    response = http.post(
        "/v1/completions", json={"model": "ragkv", "prompt": "The colours of the rainbow are", "max_tokens": 6}
    )
    assert response.status_code == 200, response.text
    usages.append({**response.json()["usage"], "cached_tokens": 0})  # a plain prefill reuses nothing
    after = scrape(http)

    def delta(name: str, **labels) -> float:
        labels = {"model_name": model, **labels}
        old = [v for sl, v in before.get(name, []) if all(sl.get(k) == w for k, w in labels.items())]
        return value(after, name, **labels) - sum(old)

    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["cached_tokens"] for u in usages)
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == completion
    assert delta("vllm:prefix_cache_queries_total") == prompt
    assert delta("vllm:prefix_cache_hits_total") == cached and cached > 0
    assert delta("vllm:time_to_first_token_seconds_count") == len(usages)
    assert delta("vllm:e2e_request_latency_seconds_count") == len(usages)
    assert delta("vllm:request_success_total") == len(usages)
    # One gap between each two sampled tokens; the end-of-sequence token is sampled too.
    itl = delta("vllm:inter_token_latency_seconds_count")
    assert completion - len(usages) <= itl <= completion
    assert delta("vllm:e2e_request_latency_seconds_sum") >= delta("vllm:time_to_first_token_seconds_sum") > 0
    assert delta("vllm:request_prefill_time_seconds_sum") <= delta("vllm:time_to_first_token_seconds_sum")
    # Idle now: nothing runs, nothing waits, no KV held.
    assert value(after, "vllm:num_requests_running", model_name=model) == 0
    assert value(after, "vllm:num_requests_waiting", model_name=model) == 0
    assert value(after, "vllm:kv_cache_usage_perc", model_name=model) == 0
    # ragkv's own families stay beside vLLM's.
    assert value(after, "ragkv_tokens_total", kind="reused") >= cached

    missing = sorted(name for name in dashboard_metric_names() if name not in after)
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"


def test_the_dashboard_is_grafana_json_on_the_vllm_names():
    dashboard = json.loads(DASHBOARD.read_text())
    names = dashboard_metric_names()
    for required in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "ragkv_chunk_lookups_total",
        "ragkv_tokens_total",
    ):
        assert required in names
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["schemaVersion"] >= 30
