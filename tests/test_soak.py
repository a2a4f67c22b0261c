"""The short soak CI runs: two real replicas over one real redis-server, mixed load from three
clients, Redis killed and restarted, then replica B killed. What the 10-minute soak measures
(BENCHMARKS.md) must already hold here: no failed request on the survivor, no acknowledged
document lost, and every fault actually injected."""

from __future__ import annotations

import pytest

from ragkv.bench.soak_bench import SoakConfig, run_soak

pytestmark = [pytest.mark.model, pytest.mark.redis, pytest.mark.slow]


def test_a_short_soak_loses_nothing_and_fails_nothing_on_the_survivor(tmp_path):
    result = run_soak(
        SoakConfig(minutes=1.0, clients=3, max_tokens=4, sample_every_s=1.0), tmp_path, progress=lambda message: None
    )
    assert [fault.what for fault in result.faults] == ["redis killed", "redis restarted", "replica b SIGKILL"]
    assert result.requests >= 10 and set(result.requests_by_kind) == {"ingest", "query", "chat"}
    assert result.errors_on_survivor == 0, result.error_examples
    assert result.documents_acknowledged > 4  # the seed corpus and documents ingested under load
    assert result.lost_documents == 0
    assert len(result.rss_mb) >= 10 and all(mb > 0 for _, mb in result.rss_mb)
    assert sum(window.requests for window in result.windows) == result.requests


def test_the_soak_config_refuses_faults_out_of_order():
    with pytest.raises(ValueError, match="in order"):
        SoakConfig(redis_restart_at=0.7, replica_kill_at=0.5)
    with pytest.raises(ValueError, match="minutes"):
        SoakConfig(minutes=0)
