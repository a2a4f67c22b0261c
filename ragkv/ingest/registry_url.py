"""Open the document registry from one URL (`--registry`, `$RAGKV_REGISTRY`).

    (none)                        the data folder's LMDB environment (embedded default)
    lmdb:///abs/path/to/dir       an LMDB environment of its own
    redis://host:6379/0           a Redis server (rediss:// for TLS, unix:///path.sock)
    redis+cluster://h1:6379,h2:6379/  a Redis Cluster (tenants spread over its masters)
        ?prefix=ragkv:registry:   key prefix (several deployments may share one database)
        &timeout=SECONDS          per-operation socket timeout, default 10
        &connect_timeout=SECONDS  default 2

Replicas on several hosts must share a Redis registry (and a Redis chunk tier); replicas
on one host may share the data folder's LMDB.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from ragkv.ingest.registry import DocumentRegistry
from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
from ragkv.ingest.registry_redis import DEFAULT_PREFIX, RedisDocumentRegistry
from ragkv.store.lmdb_env import LMDBEnvironment

REGISTRY_ENV = "RAGKV_REGISTRY"
_PASSWORD = re.compile(r"(//[^/:@]*:)[^@/]*@")
_REDIS_OPTIONS = {
    "prefix": ("prefix", str),
    "timeout": ("op_timeout_s", float),
    "connect_timeout": ("connect_timeout_s", float),
}


def registry_url_from_env() -> str | None:
    return os.environ.get(REGISTRY_ENV) or None


def open_registry(url: str | None, env: LMDBEnvironment, index_dir: Path | None = None) -> DocumentRegistry:
    """The registry `url` names; None = LMDBDocumentRegistry over `env` (the data folder's). Its
    retrieval indexes live under `index_dir` (one folder per registry), in memory if None."""
    registry = _open(url, env)
    if index_dir is not None:
        digest = hashlib.blake2b(registry.identity().encode(), digest_size=6).hexdigest()
        registry.index_folder = Path(index_dir) / f"{registry.backend}-{digest}"
    return registry


def _open(url: str | None, env: LMDBEnvironment) -> DocumentRegistry:
    if url is None:
        return LMDBDocumentRegistry(env)
    shown = _PASSWORD.sub(r"\1***@", url)
    parts = urlsplit(url)
    if parts.scheme == "lmdb":
        location = unquote(parts.netloc + parts.path)
        if not location or location == "/" or parts.query:
            raise ValueError(f"registry URL {shown!r}: expected lmdb:///abs/path or lmdb://relative/path, no options")
        return LMDBDocumentRegistry(LMDBEnvironment(os.path.expanduser(location)), owns_env=True)
    if parts.scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        options = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in _REDIS_OPTIONS:
                raise ValueError(
                    f"unknown parameter {name!r} in registry URL {shown!r}; allowed: {', '.join(_REDIS_OPTIONS)}"
                )
            key, kind = _REDIS_OPTIONS[name]
            try:
                options[key] = kind(value)
            except ValueError as error:
                raise ValueError(f"bad value {value!r} for {name!r} in registry URL {shown!r}") from error
            if kind is float and not options[key] > 0:
                raise ValueError(f"{name} must be a positive number of seconds in registry URL {shown!r}")
        if not options.get("prefix", DEFAULT_PREFIX):
            raise ValueError(f"registry URL {shown!r}: prefix must not be empty")
        # Our parameters are stripped: redis-py would read the query as its own.
        return RedisDocumentRegistry(urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")), **options)
    raise ValueError(
        f"unknown registry URL scheme {parts.scheme!r} in {shown!r}; expected lmdb:///abs/path or "
        "redis://host:port/db or redis+cluster://host:port,host:port/"
    )
