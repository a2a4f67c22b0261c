"""A vLLM OpenAI server started for a benchmark or a test, with or without RagkvConnector,
stopped (its whole process group) when the block ends.

vLLM runs from its own environment (`python`: that environment's interpreter, e.g. the
one `../shared/tools/vllm-peer-setup.sh` makes) with this checkout on its PYTHONPATH, so
the connector it loads is the code under test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = Path.home() / ".cache" / "ragkv-vllm-peer" / "venv" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def vllm_available(python: Path) -> str | None:
    """None when `python` imports vLLM (and this checkout's connector), else why not."""
    if not Path(python).is_file():
        return f"no vLLM environment at {python} (../shared/tools/vllm-peer-setup.sh makes one)"
    check = subprocess.run(
        [str(python), "-c", "import vllm, ragkv.vllm.reuse"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check.returncode:
        return f"{python} cannot import vllm and ragkv's connector: {check.stderr.strip().splitlines()[-1:]}"
    return None


def kv_transfer_config(extra: dict) -> str:
    return json.dumps(
        {
            "kv_connector": "RagkvConnector",
            "kv_connector_module_path": "ragkv.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


class VllmServer:
    """`with VllmServer(...) as server:` a vLLM OpenAI server at server.url, ready."""

    def __init__(
        self,
        python: Path,
        model: Path,
        log_path: Path,
        connector: dict | None = None,
        max_model_len: int = 8192,
        extra_args: tuple[str, ...] = (),
        env: dict | None = None,
        start_timeout: float = 900.0,
    ):
        self.python, self.model, self.log_path = Path(python), Path(model), Path(log_path)
        self.connector, self.max_model_len, self.extra_args = connector, max_model_len, extra_args
        self.env, self.start_timeout = env or {}, start_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        args = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", "model",
            "--max-model-len", str(self.max_model_len), "--dtype", "float32",
            "--disable-hybrid-kv-cache-manager", "--port", str(self.port), *self.extra_args,
        ]  # fmt: skip
        if self.connector is not None:
            args += ["--kv-transfer-config", kv_transfer_config(self.connector)]
        return args

    def __enter__(self) -> VllmServer:
        cores = os.cpu_count() or 1
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            **self.env,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            self.command(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/tmp"
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.process.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"vLLM did not start in {self.start_timeout:.0f} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass

    def reset_prefix_cache(self) -> None:
        httpx.post(f"{self.url}/reset_prefix_cache", timeout=30).raise_for_status()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")
