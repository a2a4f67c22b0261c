"""API keys: `Authorization: Bearer <key>`; each key belongs to one tenant.

Keys come from a JSON file ({"key": "tenant", ...}, or a key's entry an object with its
tenant, its own limits (ragkv.api.rate_limits) and its tenant's store budget in bytes,
"store_budget_bytes") and/or $RAGKV_API_KEYS
("key:tenant,key:tenant"). With no keys configured the API is open and every request is
tenant "default". A tenant sees only its own documents, jobs and sessions: another
tenant's ids answer 404, as if they did not exist.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from ragkv.api.errors import ApiError
from ragkv.api.rate_limits import KeyLimits
from ragkv.app.errors import InputError
from ragkv.app.request_types import check_tenant

DEFAULT_TENANT = "default"
ENV_VAR = "RAGKV_API_KEYS"
STORE_BUDGET_FIELD = "store_budget_bytes"
"""A key's field in the keys file: its tenant's own budget of chunk-store bytes."""


def _read_keys_file(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"API keys file {path} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"API keys file {path} is not valid JSON: {error}") from None
    shaped = isinstance(data, dict) and all(
        isinstance(k, str) and (isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("tenant"), str)))
        for k, v in data.items()
    )
    if not shaped:
        raise ValueError(
            f"API keys file {path} must be a JSON object mapping key -> tenant "
            '(or key -> {"tenant": ..., "max_requests_per_second": ..., "max_concurrent_requests": ..., '
            '"store_budget_bytes": ...})'
        )
    return data


def load_api_keys(path: Path | None, env: str | None = None) -> dict[str, str]:
    """key -> tenant from the file and the environment variable (ValueError when malformed)."""
    keys: dict[str, str] = {}
    if path is not None:
        keys.update({key: v if isinstance(v, str) else v["tenant"] for key, v in _read_keys_file(path).items()})
    raw = os.environ.get(ENV_VAR, "") if env is None else env
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, tenant = item.rpartition(":")
        if not sep or not key or not tenant:
            raise ValueError(f"${ENV_VAR} entries must be key:tenant, got {item!r}")
        keys[key] = tenant
    for key, tenant in keys.items():
        if len(key) < 8:
            raise ValueError("API keys must be at least 8 characters")
        try:
            check_tenant(tenant)
        except InputError as error:
            raise ValueError(str(error)) from None
    return keys


def load_key_limits(path: Path | None, default: KeyLimits) -> dict[str, KeyLimits]:
    """key -> its limits, for the keys whose file entry sets any (the others have `default`)."""
    if path is None:
        return {}
    limits = {}
    for number, (key, value) in enumerate(_read_keys_file(path).items(), 1):
        if isinstance(value, dict):
            fields = {name: v for name, v in value.items() if name not in ("tenant", STORE_BUDGET_FIELD)}
            limits[key] = KeyLimits.parse(fields, default, f"API keys file {path}, entry {number}")
    return limits


def load_store_budgets(path: Path | None) -> dict[str, int]:
    """tenant -> its store budget in bytes, from the keys file entries that set one
    (ValueError when not a positive integer, or when two keys of a tenant disagree)."""
    if path is None:
        return {}
    budgets: dict[str, int] = {}
    for number, value in enumerate(_read_keys_file(path).values(), 1):
        if not isinstance(value, dict) or STORE_BUDGET_FIELD not in value:
            continue
        budget, tenant = value[STORE_BUDGET_FIELD], value["tenant"]
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(
                f"API keys file {path}, entry {number}: {STORE_BUDGET_FIELD} must be a positive integer "
                f"(bytes), got {budget!r}"
            )
        if budgets.setdefault(tenant, budget) != budget:
            raise ValueError(
                f"API keys file {path}, entry {number}: tenant {tenant!r} has two {STORE_BUDGET_FIELD} "
                f"({budgets[tenant]} and {budget}); give its keys one"
            )
    return budgets


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the key's tenant, an id of the key (never the key) and its limits."""

    tenant: str
    key_id: str
    limits: KeyLimits


class Authenticator:
    def __init__(
        self, keys: dict[str, str], limits: dict[str, KeyLimits] | None = None, default_limits: KeyLimits = KeyLimits()
    ):
        # Compare digests in constant time; never keep a key around longer than needed.
        limits = limits or {}
        self._digests = []
        for key, tenant in keys.items():
            digest = hashlib.sha256(key.encode()).digest()
            # the key's id: a prefix of its digest (rate-limit counters, in Redis too)
            self._digests.append((digest, Caller(tenant, digest.hex()[:16], limits.get(key, default_limits))))
        self._anonymous = Caller(DEFAULT_TENANT, "", default_limits)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def tenants(self) -> set[str]:
        return {caller.tenant for _, caller in self._digests}

    def tenant_for(self, authorization: str | None) -> str:
        return self.caller_for(authorization).tenant

    def caller_for(self, authorization: str | None) -> Caller:
        if not self._digests:
            return self._anonymous
        if not authorization:
            raise ApiError(
                401,
                "missing_api_key",
                "this server needs an API key: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401,
                "bad_authorization",
                "the Authorization header must be 'Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for candidate, caller in self._digests:
            if hmac.compare_digest(candidate, digest):
                found = caller
        if found is None:
            raise ApiError(401, "invalid_api_key", "the API key is not valid", headers={"WWW-Authenticate": "Bearer"})
        return found


def tenant_of(request: Request) -> str:
    """The tenant the middleware found for the request's API key."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:  # a route outside /v1/: authenticate here
        tenant = request.app.state.authenticator.tenant_for(request.headers.get("authorization"))
    return tenant
