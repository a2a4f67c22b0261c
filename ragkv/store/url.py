"""Open a chunk store from one configuration string.

URL forms (query parameters are optional; keyword ``options`` to
:func:`open_store` take the same names and override the query)::

    lmdb:///abs/path/to/dir          LMDB directory, absolute path
    lmdb://relative/path             ... relative to the working directory
        ?map_size=BYTES              initial LMDB map size (grows on demand)
        &capacity=BYTES              keep at most BYTES of chunks (least recently used evicted,
                                     chunks never read since written first: segmented LRU)
        &protected=SHARE             share of the capacity kept for chunks read since written
                                     (default 0.65; 0: plain LRU)

    redis://host:6379/0              Redis database 0 (rediss:// for TLS)
        ?ttl=SECONDS                 expire entries after SECONDS
        &connect_timeout=SECONDS     default 0.5
        &timeout=SECONDS             per-operation socket timeout, default 1
    redis+cluster://h1:6379,h2:6379/ a Redis Cluster: any of its nodes (rediss+cluster:// for TLS);
                                     the same parameters as redis://

    tiered+lmdb:///abs/path          in-process LRU over LMDB [over Redis]
        ?lru_mb=256                  LRU size in MiB (0 disables it)
        &redis=redis://host:6379/0   optional Redis tier below LMDB (or redis+cluster://...)
        &redis_ttl=SECONDS           TTL for that Redis tier
        &map_size=BYTES              as for lmdb://
        &capacity=BYTES              as for lmdb:// (bounds the LMDB tier)
        &protected=SHARE             as for lmdb://

Example: ``tiered+lmdb:///var/lib/ragkv/kv?lru_mb=512&redis=redis://cache:6379/2``.
A Redis URL nested in ``redis=`` containing ``&`` must be percent-encoded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from ragkv.store.base import ChunkStore
from ragkv.store.blob import mac_key_of
from ragkv.store.lmdb_env import DEFAULT_MAP_SIZE
from ragkv.store.lmdb_store import LMDBStore
from ragkv.store.recency import DEFAULT_PROTECTED_SHARE
from ragkv.store.redis_client import CLUSTER_SCHEMES
from ragkv.store.redis_store import RedisStore
from ragkv.store.tiered import DEFAULT_LRU_BYTES, TieredStore

_Params = dict[str, object]
_PASSWORD_RE = re.compile(r"(//[^/:@]*:)[^@/]*@")


def _redact(text: object) -> str:
    """``repr`` for error messages, with any ``//user:password@`` password masked."""
    return repr(_PASSWORD_RE.sub(r"\1***@", text) if isinstance(text, str) else text)


def _float(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number")
    return float(value)  # type: ignore[arg-type]


def _int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    return int(value)  # type: ignore[arg-type]


def _redis_url(value: object) -> str:
    if not isinstance(value, str) or urlsplit(value).scheme not in ("redis", "rediss", *CLUSTER_SCHEMES):
        raise ValueError("expected a redis://, rediss:// or redis+cluster:// URL")
    return value


def _capacity(value: object) -> int | None:
    if value is None:
        return None
    capacity = _int(value)
    if capacity < 1:
        raise ValueError("capacity must be a positive number of bytes")
    return capacity


def _share(value: object) -> float:
    share = _float(value)
    if not 0 <= share < 1:
        raise ValueError("protected must be a share of the capacity in [0, 1)")
    return share


_LMDB_PARAMS: dict[str, Callable[[object], object]] = {"map_size": _int, "capacity": _capacity, "protected": _share}
_REDIS_PARAMS: dict[str, Callable[[object], object]] = {
    "ttl": _float,
    "connect_timeout": _float,
    "timeout": _float,
}
_TIERED_PARAMS: dict[str, Callable[[object], object]] = {
    "lru_mb": _float,
    "redis": _redis_url,
    "redis_ttl": _float,
    "map_size": _int,
    "capacity": _capacity,
    "protected": _share,
}


def open_store(url: str, *, create: bool = True, secret: str | None = None, **options: object) -> ChunkStore:
    """Open the store ``url`` describes (see the module docstring for the forms).

    ``create=False`` opens only an existing LMDB store (``FileNotFoundError`` otherwise),
    for callers that only read. ``secret`` (a deployment secret) makes every tier write
    and require a MAC instead of a CRC-32 (store.blob)."""
    mac_key = mac_key_of(secret) if secret is not None else None
    if not isinstance(url, str):
        raise TypeError(f"store URL must be a str, not {type(url).__name__}")
    parts = urlsplit(url)
    if parts.fragment:
        raise ValueError(f"store URL {_redact(url)} must not have a #fragment")
    if parts.scheme == "lmdb":
        params = _params(url, parts.query, options, _LMDB_PARAMS)
        return _open_lmdb(url, parts.netloc, parts.path, params, create, mac_key)
    if parts.scheme in ("redis", "rediss", *CLUSTER_SCHEMES):
        return _open_redis(url, options, mac_key)
    if parts.scheme == "tiered+lmdb":
        params = _params(url, parts.query, options, _TIERED_PARAMS)
        tiers: list[ChunkStore] = [_open_lmdb(url, parts.netloc, parts.path, params, create, mac_key)]
        try:
            if "redis" in params:
                ttl = {"ttl": params["redis_ttl"]} if "redis_ttl" in params else {}
                tiers.append(_open_redis(params["redis"], ttl, mac_key))
            elif "redis_ttl" in params:
                raise ValueError(f"store URL {_redact(url)}: redis_ttl given without redis=")
            lru_mb = params.get("lru_mb", DEFAULT_LRU_BYTES / (1 << 20))
            if lru_mb < 0:
                raise ValueError(f"store URL {_redact(url)}: lru_mb must be >= 0")
            return TieredStore(tiers, lru_bytes=int(lru_mb * (1 << 20)), mac_key=mac_key)
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
    raise ValueError(
        f"unknown store URL scheme {parts.scheme!r} in {_redact(url)}; expected lmdb:///abs/path, "
        "lmdb://relative/path, redis://host:port/db, redis+cluster://host:port,host:port/ or "
        "tiered+lmdb:///path?redis=redis://host:port/db&lru_mb=N"
    )


def _params(
    url: str, query: str, options: dict[str, object], allowed: dict[str, Callable[[object], object]]
) -> _Params:
    raw: dict[str, object] = {}
    # A literal '+' stays a '+' (parse_qsl would read a space): redis=redis+cluster://... works unencoded.
    for name, value in parse_qsl(query.replace("+", "%2B"), keep_blank_values=True):
        if name in raw:
            raise ValueError(f"store URL {_redact(url)} repeats the parameter {name!r}")
        raw[name] = value
    raw.update(options)
    params: _Params = {}
    for name, value in raw.items():
        if name not in allowed:
            raise ValueError(
                f"unknown parameter {name!r} for store URL {_redact(url)}; allowed: {', '.join(sorted(allowed))}"
            )
        try:
            params[name] = allowed[name](value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad value {_redact(value)} for {name!r} in store URL {_redact(url)}: {exc}") from exc
    return params


def _open_lmdb(url: str, netloc: str, path: str, params: _Params, create: bool, mac_key: bytes | None) -> LMDBStore:
    location = unquote(netloc + path)
    if not location or location == "/":
        raise ValueError(f"store URL {_redact(url)} names no LMDB directory")
    try:
        return LMDBStore(
            os.path.expanduser(location),
            map_size=params.get("map_size", DEFAULT_MAP_SIZE),
            create=create,
            mac_key=mac_key,
            capacity_bytes=params.get("capacity"),
            protected_share=params.get("protected", DEFAULT_PROTECTED_SHARE),
        )
    except FileNotFoundError:
        raise FileNotFoundError(f"no chunk store at {_redact(url)} (nothing was created)") from None


def _open_redis(url: str, options: dict[str, object], mac_key: bytes | None) -> RedisStore:
    parts = urlsplit(url)
    params = _params(url, parts.query, options, _REDIS_PARAMS)
    timeouts = {
        key: params[name]
        for name, key in (("connect_timeout", "connect_timeout_s"), ("timeout", "op_timeout_s"))
        if name in params
    }
    # Our parameters are stripped: redis-py would treat the query as its own.
    base_url = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    return RedisStore(base_url, ttl_s=params.get("ttl"), mac_key=mac_key, **timeouts)


def redis_url_of_store(store_url: str | None) -> str | None:
    """The Redis server (or cluster) a chunk store URL names (redis://..., redis+cluster://...
    or tiered+lmdb://...?redis=...)."""
    if not store_url:
        return None
    parts = urlsplit(store_url)
    if parts.scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        return f"{parts.scheme}://{parts.netloc}{parts.path}"
    if parts.scheme == "tiered+lmdb":
        nested = dict(parse_qsl(parts.query.replace("+", "%2B"))).get("redis")  # '+' of redis+cluster:// kept
        if nested:
            inner = urlsplit(nested)
            return f"{inner.scheme}://{inner.netloc}{inner.path}"
    return None
