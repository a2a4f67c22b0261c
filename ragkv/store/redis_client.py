"""One place that turns a Redis URL into a redis-py client: a single server
(redis://, rediss://, unix://) or a Redis Cluster (redis+cluster://, rediss+cluster://).

    redis+cluster://[user:password@]HOST:PORT[,HOST:PORT...]/

names some of the cluster's nodes (any of them: the client learns the slot map from the
first that answers). A cluster has no databases, so the path must be empty or "/".

Keys that one command, transaction or Lua script uses together must share a hash slot in a
cluster: `hash_tag(part)` wraps the part of a key that decides its slot (`{part}`); Redis
hashes only what is between the first `{` and the next `}`.

A single-server client connects on its first command; a cluster client needs the slot map,
so it is built on first use too (`LazyCluster`): a cluster that is down when ragkv starts is
a Redis that is down (calls fail and callers degrade), not a failed start.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SINGLE_SCHEMES = ("redis", "rediss", "unix")
SCHEMES = SINGLE_SCHEMES + CLUSTER_SCHEMES
ERRORS = (redis.RedisError, RedisClusterException)
"""What a Redis call may raise when the server or cluster fails (redis-py's cluster errors
are not RedisErrors)."""


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def hash_tag(part: str) -> str:
    """`part` as a key's hash tag, so that every key holding it lands in one cluster slot.
    Braces inside `part` would end the tag early: they are refused."""
    if "{" in part or "}" in part:
        raise ValueError(f"a hash-tagged key part must not contain braces; got {part!r}")
    return "{" + part + "}"


@dataclass(frozen=True)
class ClusterAddress:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False

    @classmethod
    def parse(cls, url: str) -> ClusterAddress:
        parts = urlsplit(url)
        if parts.scheme not in CLUSTER_SCHEMES:
            raise ValueError(f"not a Redis Cluster URL (redis+cluster://HOST:PORT,...): {parts.scheme}://...")
        if parts.path not in ("", "/"):
            raise ValueError("a Redis Cluster has no databases: the URL's path must be empty or '/'")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        username = password = None
        if userinfo:
            user, has_password, secret = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if has_password else None
        nodes = []
        for address in hosts.split(","):
            host, _, port = address.strip().rpartition(":")
            host = host.strip("[]")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"a Redis Cluster URL lists HOST:PORT nodes separated by commas; got {address!r}")
            nodes.append((host, int(port)))
        return cls(tuple(nodes), username, password, parts.scheme == "rediss+cluster")

    def where(self) -> str:
        return "cluster " + ",".join(f"{host}:{port}" for host, port in self.nodes)


class LazyCluster:
    """A RedisCluster built on first use; until then, and while building fails, every call
    raises redis.ConnectionError (so callers treat it as a Redis that is down)."""

    def __init__(self, address: ClusterAddress, **options):
        self._address = address
        self._options = options
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def _built(self) -> RedisCluster:
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is None:
                try:
                    self._client = RedisCluster(
                        startup_nodes=[ClusterNode(host, port) for host, port in self._address.nodes],
                        username=self._address.username,
                        password=self._address.password,
                        ssl=self._address.tls,
                        **self._options,
                    )
                except ERRORS as error:
                    raise redis.ConnectionError(f"redis {self._address.where()}: {error}") from error
            return self._client

    def __getattr__(self, name: str):
        return getattr(self._built(), name)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def redis_client(url: str, *, connect_timeout_s: float, op_timeout_s: float, retries: int = 0):
    """A client for `url`: redis.Redis, or a LazyCluster for a cluster URL. `retries`: how
    often a command is retried after a connection error (0: fail fast, the caller backs off)."""
    retry = Retry(NoBackoff(), retries)
    if is_cluster_url(url):
        return LazyCluster(
            ClusterAddress.parse(url),
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=op_timeout_s,
            retry=retry,
        )
    return redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=op_timeout_s, retry=retry)


def where(url: str) -> str:
    """Where `url` points, for messages: never the URL itself (it may hold a password)."""
    if is_cluster_url(url):
        return ClusterAddress.parse(url).where()
    parts = urlsplit(url)
    return parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}{parts.path}"
