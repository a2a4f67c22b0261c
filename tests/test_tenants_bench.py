"""`ragkv bench tenants`: the traffic it sends, the figures it computes, the options it refuses
(no model), and one tiny run against a real server (model)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from ragkv.bench.datasets import Example
from ragkv.bench.tenants_bench import ServerFigures, phase_figures, run_figures, tenant_readings
from ragkv.bench.tenants_workload import Answer, TenantsConfig, Traffic, interleave
from ragkv.cli import bench_tenants
from ragkv.cli.main import build_parser


def _examples(count: int = 20, passages: int = 4) -> list[Example]:
    return [
        Example(f"question {e}?", [f"passage {e}-{p} " + "word " * 10 for p in range(passages)], ["x"])
        for e in range(count)
    ]


@pytest.mark.parametrize("count, rate", [(5, 4.0), (7, 0.5), (3, 1.5), (10, 2.0)])
def test_interleave_sends_b_at_its_rate_before_each_a_question(count, rate):
    order = interleave(count, rate)
    assert order.count("A") == count and order.count("B") == round(rate * count)
    a_at = [i for i, who in enumerate(order) if who == "A"]
    for number, position in enumerate(a_at):  # B's requests sent before A's question `number`
        assert order[:position].count("B") == round(rate * (number + 1))


def _config(**changes) -> TenantsConfig:
    settings = {"dataset": Path("x.json"), "a_questions": 4, "a_pool": 6, "passages": 2, "last": 2}
    return TenantsConfig(**{**settings, **changes})


def test_traffic_a_draws_from_its_pool_and_b_pastes_new_sets():
    config = _config(b_rate=3.0, b_repeats=2)
    traffic = Traffic(config, _examples(), len)
    recurring = traffic.b_prompts("recurring")
    flood = traffic.b_prompts("flood")
    assert len(recurring) == len(flood) == 12
    texts = [tuple(p.body["messages"][0]["content"].split("\n\n")[1:]) for p in recurring]
    assert texts[0::2] == texts[1::2] and len(set(texts)) == 6  # each set asked twice in a row
    flood_sets = {p.body["messages"][0]["content"] for p in flood}
    assert len(flood_sets) == 12  # each set once
    pool = set(traffic.a_pool)
    for prompt in traffic.a_prompts():
        content = prompt.body["messages"][0]["content"]
        pasted = [p for p in pool if p in content]
        assert len(pasted) == 2 and prompt.reusable_tokens == sum(map(len, pasted))
    for prompt in flood:
        assert not any(p in prompt.body["messages"][0]["content"] for p in pool)


def test_traffic_is_the_same_after_a_restart_and_the_phase_interleaves():
    traffic = Traffic(_config(), _examples(), len)
    first = traffic.phase("flood")
    traffic.restart()
    assert traffic.phase("flood") == first
    assert [p.tenant for p in first] == interleave(4, 4.0)


def test_traffic_refuses_a_set_too_small_for_the_flood():
    with pytest.raises(ValueError, match="distinct passages"):
        Traffic(_config(a_questions=20, b_rate=4.0), _examples(count=10), len)


def _answer(tenant: str, cached: int, reusable: int, ttft: float, ok: bool = True) -> Answer:
    return Answer(tenant, ok, ttft, reusable + 20, cached, reusable)


def test_phase_figures_take_the_hit_rate_and_ttft_over_the_last_questions():
    answers = [
        _answer("A", 0, 100, 5.0),
        _answer("B", 0, 50, 4.0),
        _answer("A", 30, 100, 3.0),
        _answer("B", 50, 50, 1.0),
        _answer("A", 90, 120, 1.0),
        _answer("A", 0, 0, 9.0, ok=False),
        _answer("A", 100, 100, 2.0),
    ]
    before = {"bytes": {"A": 10.0}, "evictions": {"A": 1.0, "B": 2.0}}
    after = {"bytes": {"A": 300.0, "B": 200.0}, "evictions": {"A": 1.0, "B": 7.0, "": 1.0}}
    figures = phase_figures(answers, 2, 12.3456, before, after)
    # the last two answered A questions: 90/120 and 100/100
    assert figures.a_hit_rate_last == round(190 / 220, 4)
    assert figures.a_hit_rate_all == round(220 / 420, 4)
    assert figures.a_ttft_p50_last_s == 1.5 and figures.a_ttft_p50_all_s == 2.5
    assert figures.b_hit_rate == 0.5 and figures.b_requests == 2 and figures.b_errors == 0
    assert figures.a_requests == 5 and figures.a_errors == 1
    assert figures.evictions == {"A": 0.0, "B": 5.0, "": 1.0}
    assert figures.tenant_bytes == {"A": 300.0, "B": 200.0} and figures.wall_s == 12.35


def test_run_figures_judge_the_goals():
    empty = {"bytes": {}, "evictions": {}}
    alone = phase_figures([_answer("A", 80, 100, 2.0)], 1, 1.0, empty, empty)
    held = phase_figures([_answer("A", 77, 100, 2.3)], 1, 1.0, empty, empty)
    lost = phase_figures([_answer("A", 60, 100, 2.1)], 1, 1.0, empty, empty)
    slow = phase_figures([_answer("A", 80, 100, 2.5)], 1, 1.0, empty, empty)
    assert run_figures("flood", False, 1, None, ServerFigures(alone, held)).meets_goals is True
    run = run_figures("flood", False, 1, None, ServerFigures(alone, lost))
    assert run.hit_rate_change == -0.2 and run.meets_goals is False
    run = run_figures("recurring", True, 1, 1, ServerFigures(alone, slow))
    assert run.ttft_ratio == 1.25 and run.meets_goals is False
    assert run.cold_ratio is None and run.cold_meets_goal is None  # no cold prompts sent


def test_run_figures_judge_a_cold_prompt_at_the_cap_against_the_empty_store():
    empty = {"bytes": {}, "evictions": {}}
    alone = phase_figures([_answer("A", 80, 100, 2.0)], 1, 1.0, empty, empty)
    full = {"bytes": {"A": 70.0, "B": 30.0}, "evictions": {}}
    beside = phase_figures([_answer("A", 80, 100, 2.0)], 1, 1.0, empty, full)
    cold = [_answer("B", 0, 100, t) for t in (4.0, 3.0, 9.0)]  # p50 4.0
    held = ServerFigures(alone, beside, cold, [_answer("B", 0, 100, t) for t in (4.2, 4.3, 1.0)])
    run = run_figures("flood", False, 1, None, held)
    assert (run.cold_ttft_p50_empty_s, run.cold_ttft_p50_at_cap_s, run.cold_ratio) == (4.0, 4.2, 1.05)
    assert run.cold_meets_goal is True and run.store_bytes_at_cap == 100.0
    slow = ServerFigures(alone, beside, cold, [_answer("B", 0, 100, t) for t in (4.8, 4.6, 5.0)])
    assert run_figures("flood", False, 1, None, slow).cold_meets_goal is False


def test_cold_prompts_paste_sets_no_other_prompt_pastes():
    config = _config(b_rate=2.0, cold=3)
    traffic = Traffic(config, _examples(), len)
    empty, at_cap = traffic.cold_prompts(at_capacity=False), traffic.cold_prompts(at_capacity=True)
    assert len(empty) == len(at_cap) == 3

    def pasted(prompts):
        return [tuple(p.body["messages"][0]["content"].split("\n\n")[1:]) for p in prompts]

    cold_sets = pasted(empty) + pasted(at_cap)
    passages = [p for s in cold_sets for p in s]
    assert all(len(s) == 2 for s in cold_sets) and len(set(passages)) == 12
    others = pasted(traffic.b_prompts("flood")) + pasted([traffic.warm_up()]) + pasted(traffic.a_prompts())
    assert not set(passages) & {p for s in others for p in s}


def test_tenant_readings_parse_the_prometheus_text():
    registry = CollectorRegistry()
    Gauge("ragkv_store_tenant_bytes", "bytes", ["tenant"], registry=registry).labels("A").set(123)
    evictions = Counter("ragkv_store_tenant_evictions", "evictions", ["tenant"], registry=registry)
    evictions.labels("B").inc(4)
    evictions.labels("").inc(1)
    readings = tenant_readings(generate_latest(registry).decode())
    assert readings == {"bytes": {"A": 123.0}, "evictions": {"B": 4.0, "": 1.0}}


@pytest.mark.parametrize(
    "options, message",
    [
        (["--last", "30"], "last <= a_questions"),
        (["--b-repeats", "1"], "b_repeats >= 2"),
        (["--b-rate", "0"], "b_rate > 0"),
        (["--modes", "bursty"], "modes must be among"),
        (["--passages", "20"], "passages <= a_pool"),
        (["--store-capacity-mb", "-1"], "capacity_mb must be > 0"),
        (["--budget-share", "1.5"], "budget_share"),
        (["--a-questions", "400"], "distinct passages"),
        (["--a-questions", "30", "--cold", "30"], "cold prompts"),
    ],
)
def test_bad_options_exit_with_a_message(options, message, tmp_path, capsys):
    data = tmp_path / "set.json"  # 300 distinct passages: enough for the defaults' flood
    ctxs = [[{"title": "", "text": f"text {e}-{p}"} for p in range(10)] for e in range(30)]
    data.write_text(json.dumps([{"question": f"q{e}?", "answers": ["a"], "ctxs": c} for e, c in enumerate(ctxs)]))
    args = build_parser().parse_args(["bench", "tenants", "--data", str(data), *options])
    with pytest.raises(SystemExit, match=message):
        bench_tenants.run(args)


@pytest.mark.model
def test_a_tiny_run_against_a_real_server_counts_both_tenants_and_keeps_the_cap(tmp_path):
    from ragkv.bench.datasets import load_examples
    from ragkv.bench.tenants_bench import run_tenants

    # a data set of its own (the dev set is not in the checkout): distinct passages of common words
    words = "the harbour board built a lantern in the old town by the river and kept its plans".split()
    rng = random.Random(0)
    ctxs = [
        [{"title": "", "text": " ".join(rng.choice(words) for _ in range(90))} for _ in range(10)] for _ in range(6)
    ]
    data = tmp_path / "set.json"
    data.write_text(
        json.dumps([{"question": f"Who built {e}?", "answers": ["a"], "ctxs": c} for e, c in enumerate(ctxs)])
    )
    config = TenantsConfig(
        dataset=data,
        a_questions=2,
        last=1,
        a_pool=2,
        passages=1,
        b_rate=2.0,
        passage_words=80,
        max_tokens=2,
        cold=1,
        capacity_mb=2.0,
        modes=("flood",),
        budgets=(False,),
    )
    result = run_tenants(config, load_examples(data), progress=lambda message: None)
    (run,) = result.runs
    assert result.capacity_bytes == 2 * 2**20 and result.uncapped_alone is None
    assert (run.alone.a_requests, run.alone.b_requests, run.alone.a_errors) == (2, 0, 0)
    beside = run.beside_b
    assert (beside.a_requests, beside.b_requests, beside.a_errors, beside.b_errors) == (2, 4, 0, 0)
    # B's flood of one-off passages (each some hundreds of KiB of KV) overflows 2 MiB: the
    # store evicted, and holds no more than its cap (every tenant's bytes, shared as "")
    assert sum(beside.evictions.values()) > 0
    assert 0 < sum(beside.tenant_bytes.values()) <= result.capacity_bytes
    assert beside.tenant_bytes.get("A", 0) > 0 and beside.tenant_bytes.get("B", 0) > 0
    assert 0 <= run.alone.a_hit_rate_all <= 1.05 and beside.a_ttft_p50_all_s > 0
    assert run.cold_ttft_p50_empty_s > 0 and run.cold_ttft_p50_at_cap_s > 0 and run.cold_ratio > 0
    json.dumps(result.to_json())  # the figures a --json file holds


def test_a_pool_prompts_paste_the_whole_pool_once():
    traffic = Traffic(_config(a_pool=5, passages=2), _examples(), len)
    contents = [p.body["messages"][0]["content"] for p in traffic.a_pool_prompts()]
    assert len(contents) == 3
    assert all(sum(p in c for c in contents) == 1 for p in traffic.a_pool)
