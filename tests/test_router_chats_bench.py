"""The router chats benchmark's own logic: its settings, the chats it builds, its summary,
and the message when no router binary is found (the runs themselves start real replicas and
a real vllm-router: `ragkv serve followup --replicas --router`)."""

import json

import pytest

from ragkv.bench.router_chats_bench import FOLLOW_UPS, SYSTEM, FrontResult, RouterChatsConfig, Turn, chats_for
from ragkv.bench.router_process import RouterProcess, find_router


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("clients", 0, "clients"),
        ("turns", 1, "turns"),
        ("turns", 2 + len(FOLLOW_UPS), "turns"),
        ("passages", 0, "passages"),
    ],
)
def test_config_refuses_bad_settings(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        RouterChatsConfig(tmp_path / "d.json", "vllm-router", **{field: value})


def test_chats_paste_the_passages_and_ask_the_follow_ups(tmp_path):
    samples = [{"question": f"q{n}?", "ctxs": [{"text": f"passage {n}.{k}"} for k in range(4)]} for n in range(5)]
    dataset = tmp_path / "d.json"
    dataset.write_text(json.dumps(samples))
    config = RouterChatsConfig(dataset, "vllm-router", turns=3, passages=2)
    chats = chats_for(dataset, 2, 3, config)
    assert [chat.questions for chat in chats] == [("q3?", *FOLLOW_UPS[:2]), ("q4?", *FOLLOW_UPS[:2])]
    assert chats[0].system == SYSTEM + "passage 3.0\n\npassage 3.1"
    with pytest.raises(SystemExit, match="too few samples"):
        chats_for(dataset, 3, 3, config)


def test_summary_counts_follow_ups_apart_from_first_turns():
    result = FrontResult("cache_aware", context_fetches=1, wall_s=3.0)
    result.turns = [
        Turn(0, 1, ttft_s=5.0, prompt_tokens=100, cached_tokens=0),
        Turn(0, 2, ttft_s=1.0, prompt_tokens=120, cached_tokens=100),
        Turn(0, 3, ttft_s=3.0, prompt_tokens=140, cached_tokens=120),
        Turn(1, 1, ttft_s=7.0, prompt_tokens=100, cached_tokens=0),
        Turn(1, 2, error="503 busy"),
    ]
    summary = result.summary()
    assert summary["follow_up_ttft_p50_s"] == 2.0
    assert summary["turn_1_ttft_p50_s"] == 6.0
    assert summary["follow_up_cached_share"] == round(220 / 260, 4)
    assert (summary["follow_ups"], summary["errors"], summary["context_fetches"]) == (2, 1, 1)


def test_a_missing_router_binary_says_how_to_get_one(tmp_path):
    with pytest.raises(SystemExit, match="install_router.sh"):
        find_router(str(tmp_path / "no-such-router"))


def test_router_policy_is_checked():
    with pytest.raises(ValueError, match="policy"):
        RouterProcess("vllm-router", "random", ["http://127.0.0.1:1"])


def test_rounds_pool_into_one_result_per_front():
    first = FrontResult("pinned", context_fetches=0, wall_s=2.0, requests_per_replica=[3, 3])
    first.computed_tokens_per_replica = [100, 90]
    first.turns = [Turn(0, 2, ttft_s=1.0, prompt_tokens=10, cached_tokens=9)]
    second = FrontResult("pinned", context_fetches=1, wall_s=3.0, requests_per_replica=[2, 4])
    second.computed_tokens_per_replica = [50, 70]
    second.turns = [Turn(1, 2, ttft_s=3.0, prompt_tokens=10, cached_tokens=9)]
    pooled = FrontResult.pooled("pinned", [first, second])
    assert (pooled.wall_s, pooled.context_fetches) == (5.0, 1)
    assert (pooled.requests_per_replica, pooled.computed_tokens_per_replica) == ([5, 7], [150, 160])
    assert pooled.summary()["follow_up_ttft_p50_s"] == 2.0
