"""The config file (`--config ragkv.toml`, $RAGKV_CONFIG) and the server's logs: which value
wins (flag > file > environment > default), clear errors for bad files, and the access
log / JSON log lines. No model is loaded."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from ragkv.api.access_log import AccessLogMiddleware
from ragkv.api.auth import Authenticator
from ragkv.api.metrics import Metrics
from ragkv.api.middleware import ServingMiddleware
from ragkv.cli.config_file import ConfigFileError, config_path, load_config
from ragkv.cli.logs import JsonFormatter
from ragkv.cli.main import build_parser
from ragkv.cli.options import storage_config
from ragkv.cli.serve import serve_config


def parse(tmp_path: Path, toml: str, argv: list[str]):
    path = tmp_path / "ragkv.toml"
    path.write_text(toml)
    return build_parser(argv[0], (path, load_config(path))).parse_args(argv)


def test_flag_beats_file_beats_environment_beats_default(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_HOME", str(tmp_path / "from-env"))
    monkeypatch.setenv("RAGKV_REGISTRY", "redis://env-host:6379/1")
    toml = (
        'data-dir = "/srv/from-file"\nregistry = "redis://file-host:6379/1"\n'
        '[serve]\nport = 9001\naccess-log = false\nlog-format = "json"\nmax_top_k = 4\n'
    )
    from_file = serve_config(parse(tmp_path, toml, ["serve"]))
    assert (from_file.port, from_file.access_log, from_file.log_format, from_file.max_top_k) == (9001, False, "json", 4)
    assert from_file.runtime.data_dir == Path("/srv/from-file")
    assert from_file.runtime.registry_url == "redis://file-host:6379/1"
    assert from_file.max_new_tokens == 1024  # in neither: the default

    flags = serve_config(
        parse(tmp_path, toml, ["serve", "--port", "9100", "--access-log", "--registry", "redis://flag:1/0"])
    )
    assert (flags.port, flags.access_log, flags.runtime.registry_url) == (9100, True, "redis://flag:1/0")

    from_env = storage_config(parse(tmp_path, "[serve]\nport = 9001\n", ["docs", "list"]))
    assert from_env.data_dir == tmp_path / "from-env" and from_env.registry_url == "redis://env-host:6379/1"


def test_command_tables_win_over_top_level_keys(tmp_path):
    args = parse(tmp_path, 'tenant = "shared"\n[docs]\ntenant = "docs-only"\n', ["docs", "list"])
    assert args.tenant == "docs-only"
    assert parse(tmp_path, 'tenant = "shared"\n[docs]\ntenant = "docs-only"\n', ["serve"]).tenant == "shared"


def test_top_level_keys_of_other_commands_are_ignored(tmp_path):
    args = parse(tmp_path, "chunk-tokens = 256\nport = 9001\n", ["docs", "list"])  # ingest's and serve's options
    assert args.action == "list"


@pytest.mark.parametrize(
    "toml, message",
    [
        ("prot = 9001\n", "'prot' (no ragkv command has them)"),
        ("[serve]\ntop-k = 5\n", "[serve] unknown option(s) 'top-k' for `ragkv serve`"),
        ('[serve]\nport = "high"\n', "port: bad value 'high'"),
        ("[serve]\nport = 80.5\n", "port must be an integer"),
        ('[serve]\naccess-log = "yes"\n', "access-log must be true or false"),
        ('[serve]\nlog-level = "loud"\n', "log-level must be one of"),
        ("[serve]\nstore = 5\n", "store must be a string"),
        ("serve = 3\n", "[serve] must be a table"),
    ],
)
def test_bad_config_files_are_refused_with_the_key_named(tmp_path, toml, message):
    with pytest.raises(ConfigFileError) as raised:
        parse(tmp_path, toml, ["serve"])
    assert message in str(raised.value) and str(tmp_path) in str(raised.value)


def test_config_path_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("RAGKV_CONFIG", raising=False)
    assert config_path(["serve"]) is None
    assert config_path(["--config", "a.toml", "serve"]) == Path("a.toml")
    assert config_path(["serve", "--config=b.toml"]) == Path("b.toml")
    monkeypatch.setenv("RAGKV_CONFIG", "c.toml")
    assert config_path(["serve"]) == Path("c.toml")


def _ragkv(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ragkv", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
    )


def test_the_command_reads_the_file_and_reports_bad_ones(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(f'data-dir = "{tmp_path / "from-file"}"\n')
    result = _ragkv("docs", "list", "--config", str(good))  # read-only: says where it looked, creates nothing
    assert result.returncode == 2 and str(tmp_path / "from-file" / "db") in result.stderr
    result = _ragkv("docs", "list", RAGKV_CONFIG=str(good))
    assert result.returncode == 2 and str(tmp_path / "from-file" / "db") in result.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("port = \n")
    result = _ragkv("--config", str(broken), "docs", "list")
    assert result.returncode == 2 and "not valid TOML" in result.stderr and "Traceback" not in result.stderr
    result = _ragkv("docs", "list", "--config", str(tmp_path / "missing.toml"))
    assert result.returncode == 2 and "does not exist" in result.stderr
    assert not (tmp_path / "from-file").exists()


# -- logs ------------------------------------------------------------------------------------


def test_access_log_lines_carry_request_id_tenant_status_and_latency():
    async def ok(request):
        return PlainTextResponse("fine")

    async def boom(request):
        raise RuntimeError("handler failed")

    app = Starlette(routes=[Route("/v1/ok", ok), Route("/v1/boom", boom)])
    app = ServingMiddleware(app, Metrics(), Authenticator({"secret-key-0001": "alice"}), 1 << 16, 1 << 16)
    app = AccessLogMiddleware(app)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ragkv.access")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    async def scenario():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            ok_response = await client.get(
                "/v1/ok", headers={"Authorization": "Bearer secret-key-0001", "X-Request-Id": "req-given-1"}
            )
            denied = await client.get("/v1/ok")
            failed = await client.get("/v1/boom", headers={"Authorization": "Bearer secret-key-0001"})
        return ok_response, denied, failed

    try:
        ok_response, denied, failed = asyncio.run(scenario())
    finally:
        logger.removeHandler(handler)
    assert [r.status for r in records] == [200, 401, 500] and failed.status_code == 500
    first = json.loads(JsonFormatter().format(records[0]))
    assert first["logger"] == "ragkv.access" and first["level"] == "info"
    assert {k: first[k] for k in ("method", "path", "status", "request_id", "tenant")} == {
        "method": "GET",
        "path": "/v1/ok",
        "status": 200,
        "request_id": "req-given-1",
        "tenant": "alice",
    }
    assert first["latency_ms"] >= 0 and "GET /v1/ok 200" in first["message"] and "tenant=alice" in first["message"]
    assert records[1].request_id == denied.headers["x-request-id"] and records[1].tenant == "-"


def test_json_formatter_writes_one_object_with_the_exception():
    try:
        raise ValueError("bad thing")
    except ValueError:
        record = logging.getLogger("ragkv.test").makeRecord(
            "ragkv.test", logging.ERROR, __file__, 1, "failed %s", ("x",), sys.exc_info(), extra={"tenant": "alice"}
        )
    line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert "\n" not in line and entry["message"] == "failed x" and entry["tenant"] == "alice"
    assert entry["level"] == "error" and "ValueError: bad thing" in entry["exception"]
