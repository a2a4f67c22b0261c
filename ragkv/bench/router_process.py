"""A vllm-router process in front of ragkv replicas (benchmarks; deploy/router.Dockerfile runs
the same binary in production). `scripts/install_router.sh` installs it in a venv of its own."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from ragkv.api.launcher import free_port

INSTALLED = Path.home() / ".cache" / "ragkv-router" / "venv" / "bin" / "vllm-router"
POLICIES = ("round_robin", "cache_aware")


def find_router(binary: str | None = None) -> str:
    """The vllm-router binary: `binary` when given, else one on PATH, else the one
    scripts/install_router.sh installs; SystemExit with the way to get one if none is found."""
    found = shutil.which(binary) if binary else shutil.which("vllm-router")
    if found is None and binary is None and INSTALLED.exists():
        found = str(INSTALLED)
    if found is None:
        raise SystemExit(
            f"no vllm-router binary {'at ' + binary if binary else 'found'}: "
            "run scripts/install_router.sh (it prints the path) or pip install vllm-router"
        )
    return found


class RouterDidNotStart(RuntimeError):
    """The router exited or did not answer /health in time."""


class RouterProcess:
    """`vllm-router --worker-urls ... --policy P` on a free loopback port; a context manager
    that returns once the router's /health answers 200 and stops it on exit."""

    def __init__(self, binary: str, policy: str, workers: list[str], log_path: Path | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.binary, self.policy, self.workers = binary, policy, list(workers)
        self.port = free_port()
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RouterProcess:
        command = [self.binary, "--worker-urls", *self.workers, "--policy", self.policy]
        command += ["--health-check-endpoint", "/health", "--host", "127.0.0.1", "--port", str(self.port)]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.__exit__(None, None, None)
                raise RouterDidNotStart(f"vllm-router ({self.policy}) did not answer /health within 60 s")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
