"""A real, throwaway `redis-server` on a free loopback port (tests and the soak benchmark).

Persistence is off unless asked for; the soak turns the append-only file on (fsync on
every write) so a restart loses nothing that was acknowledged, as a production Redis
configured for a registry would.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

from ragkv.api.launcher import free_port


class RedisServer:
    """`redis-server` subprocess; `stop` kills it (SIGKILL), `start` (re)starts it on the same port."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        appendonly: bool = False,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError(
                "redis-server not found on PATH; tests and the soak need a real server "
                "(Debian/Ubuntu: apt-get install redis-server)"
            )
        self.binary = found
        self.appendonly = appendonly
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self._dir = tempfile.mkdtemp(prefix="ragkv-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        if self._process is not None:
            raise RuntimeError("redis-server is already running")
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        self._process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *persistence,
                "--dir",
                self._dir,
                "--loglevel",
                "warning",
                *self.extra_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while not self._answers_ping():
            if self._process.poll() is not None:
                output = self._process.stdout.read().decode(errors="replace") if self._process.stdout else ""
                self._process = None
                raise RuntimeError(f"redis-server exited during startup:\n{output}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer PING on port {self.port} within {timeout_s}s")
            time.sleep(0.01)

    def stop(self) -> None:
        """Kill the server (SIGKILL: an abrupt outage, like a crashed cache node)."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(timeout=10)
            if process.stdout:
                process.stdout.close()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False
