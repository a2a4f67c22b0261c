"""A real three-master Redis Cluster on loopback ports, for the cluster tests.

Three `redis-server --cluster-enabled yes` processes joined by `redis-cli --cluster create
... --cluster-replicas 0`: every master owns a third of the slots and has no replica, so
killing one loses its slots, as losing a single Redis loses everything. Coverage is not
required (`cluster-require-full-coverage no`): the surviving masters keep answering for
their own slots, and a short node timeout makes the cluster notice a dead master quickly.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time

from redis.cluster import RedisCluster
from redis_server import RedisServer

_CLUSTER_ARGS = (
    "--cluster-enabled",
    "yes",
    "--cluster-node-timeout",
    "1000",
    "--cluster-require-full-coverage",
    "no",
    "--cluster-config-file",
    "nodes.conf",
)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterServers:
    def __init__(self, masters: int = 3) -> None:
        if shutil.which("redis-cli") is None:
            raise FileNotFoundError(
                "redis-cli not found on PATH; the cluster tests need it (apt-get install redis-tools)"
            )
        self.nodes = [RedisServer(port=_cluster_port(), extra_args=_CLUSTER_ARGS) for _ in range(masters)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes) + "/"

    def start(self, timeout_s: float = 30.0) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while not all(self.state(node) == "ok" for node in self.nodes):
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    @staticmethod
    def state(node: RedisServer) -> str | None:
        result = subprocess.run(
            ["redis-cli", "-p", str(node.port), "cluster", "info"], capture_output=True, text=True, timeout=5
        )
        for line in result.stdout.splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return None

    def master_of(self, key: bytes | str) -> RedisServer:
        """The node that owns `key`'s slot."""
        client = RedisCluster(host="127.0.0.1", port=self.nodes[0].port)
        try:
            port = client.get_node_from_key(key).port
        finally:
            client.close()
        return next(node for node in self.nodes if node.port == port)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
