"""Schemathesis against a real `ragkv serve` with an API key: every check, bounded
examples, a fixed seed. It must find no server error and no conformance failure (status
codes, content types, response bodies and headers as /openapi.json declares them).

Answers are capped at a few tokens so the generated requests run in minutes on a CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ragkv.api.launcher import ServerProcess

pytestmark = [pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
KEY = "schemathesis-key-01"
EXAMPLES_PER_OPERATION = 10
SEED = 20261123
_CLI = "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())"


def test_schemathesis_finds_no_server_error_and_no_conformance_failure(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY: "fuzz"}))
    args = [
        "--data-dir",
        str(tmp_path / "data"),
        "--api-keys",
        str(keys),
        "--max-new-tokens",
        "8",
        "--max-top-k",
        "4",
        "--log-level",
        "warning",
    ]
    with ServerProcess(args, log_path=tmp_path / "serve.log") as server:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as http:
            for path in sorted((ROOT / "examples" / "corpus").iterdir()):  # something to retrieve
                assert http.post("/v1/documents", json={"text": path.read_text(), "name": path.name}).status_code == 201
        run = subprocess.run(
            [
                sys.executable,
                "-c",
                _CLI,
                "--config-file",
                str(ROOT / "tests" / "schemathesis.toml"),
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "all",
                "--header",
                f"Authorization: Bearer {KEY}",
                "--max-examples",
                str(EXAMPLES_PER_OPERATION),
                "--seed",
                str(SEED),
                "--workers",
                "1",
                "--phases",
                "examples,coverage,fuzzing,stateful",
                "--request-timeout",
                "180",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=1500,
            cwd=tmp_path,
        )  # its cache folder stays out of the tree
        server_log = server.log()
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-3000:] + "\n-- server log --\n" + server_log
    assert "Traceback" not in server_log, server_log
