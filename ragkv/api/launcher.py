"""Start `ragkv serve` in a subprocess and wait until it answers (tests, benchmarks, demos)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

_MAIN = "import sys; from ragkv.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`ragkv serve --port <free> <args>`; `start()` returns once /health answers."""

    def __init__(
        self,
        args: list[str] = (),
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ):
        self.port = port or free_port()
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self._own_log = log_path is None  # a temporary log is removed by stop()
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="ragkv-serve-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> ServerProcess:
        self._log = open(self.log_path, "ab")
        command = [sys.executable, "-c", _MAIN, "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                message = f"ragkv serve exited with {self.process.returncode}:\n{self.log()}"
                self.stop()
                raise RuntimeError(message)
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code in (200, 503):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        message = f"ragkv serve did not answer within {timeout_s} s:\n{self.log()}"
        self.stop()
        raise TimeoutError(message)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        self._log.close()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
