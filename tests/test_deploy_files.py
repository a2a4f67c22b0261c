"""The deployment files say what the README promises (no Docker engine needed): a CPU torch
by default, one image built once for every replica, Redis split so that chunk traffic
never evicts sessions and nothing evicts the corpus, an unprivileged user, and a config
file that `ragkv serve` accepts."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ragkv.cli.config_file import load_config
from ragkv.cli.main import build_parser
from ragkv.cli.serve import serve_config

ROOT = Path(__file__).resolve().parents[1]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def redis_policy(service: dict) -> str:
    command = service["command"]
    return command[command.index("--maxmemory-policy") + 1]


def test_the_image_is_cpu_torch_and_runs_unprivileged():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", dockerfile, re.M)
    assert re.search(r"^USER ragkv$", dockerfile, re.M) and "useradd" in dockerfile
    api = compose()["services"]["api"]
    assert api["build"]["args"]["TORCH_INDEX"].endswith("download.pytorch.org/whl/cpu}")


def test_every_replica_runs_the_one_image_built_once():
    services = compose()["services"]
    replicas = {name: s for name, s in services.items() if s.get("image", "").startswith("ragkv:")}
    assert set(replicas) == {"api", "api-2"}
    assert len({s["image"] for s in replicas.values()}) == 1
    assert [name for name, s in replicas.items() if "build" in s] == ["api"]
    assert replicas["api-2"]["pull_policy"] == "never"
    volumes = [next(v for v in s["volumes"] if v.endswith(":/data")) for s in replicas.values()]
    assert len(set(volumes)) == 2  # a data folder each, as on two hosts


def test_chunks_sessions_and_registry_live_in_separate_redis_instances():
    services = compose()["services"]
    assert redis_policy(services["redis-cache"]) == "allkeys-lru"
    assert redis_policy(services["redis-sessions"]) == "allkeys-lru"
    registry = services["redis-registry"]
    assert redis_policy(registry) == "noeviction" and "--appendonly" in registry["command"]
    assert registry["command"][registry["command"].index("--appendonly") + 1] == "yes"


def test_the_deployed_config_file_is_one_serve_accepts():
    path = ROOT / "deploy" / "ragkv.toml"
    config = serve_config(build_parser("serve", (path, load_config(path))).parse_args(["serve"]))
    assert config.host == "0.0.0.0" and config.log_format == "json"
    assert "redis-cache" in config.runtime.store_url
    assert config.runtime.registry_url.startswith("redis://redis-registry")
    assert config.session_store.startswith("redis://redis-sessions")
    assert config.shared_context_mb * 2**20 < 0.5 * 2**30  # under half of the sessions Redis's 1 GB
    mounted = {v.split(":")[1] for v in compose()["services"]["api"]["volumes"] if v.startswith("./deploy/")}
    assert compose()["services"]["api"]["environment"]["RAGKV_CONFIG"] in mounted


def test_the_replicas_profile_puts_a_cache_aware_router_in_front_checked_at_health():
    services = compose()["services"]
    router = services["router"]
    assert router["profiles"] == ["replicas"] and router["ports"] == ["8080:8080"]
    command = router["command"]
    assert command[command.index("--policy") + 1] == "cache_aware"
    workers = command[command.index("--worker-urls") + 1 : command.index("--policy")]
    assert workers == ["http://api:8000", "http://api-2:8000"]
    assert command[command.index("--health-check-endpoint") + 1] == "/health"
    assert {name: c["condition"] for name, c in router["depends_on"].items()} == {
        "api": "service_healthy",
        "api-2": "service_healthy",
    }
    for name, port in (("api", 8000), ("api-2", 8000), ("router", 8080)):
        assert f"http://127.0.0.1:{port}/health" in " ".join(services[name]["healthcheck"]["test"])
    dockerfile = (ROOT / "deploy" / router["build"]["dockerfile"]).read_text()
    assert re.search(r'pip install .*"vllm-router==\$\{VLLM_ROUTER_VERSION\}"', dockerfile)
    assert re.search(r"^USER router$", dockerfile, re.M)
