"""API keys: `Authorization: Bearer <key>`; each key belongs to one tenant.

Keys come from a JSON file ({"key": "tenant", ...}) and/or $RAGKV_API_KEYS
("key:tenant,key:tenant"). With no keys configured the API is open and every request is
tenant "default". A tenant sees only its own documents, jobs and sessions: another
tenant's ids answer 404, as if they did not exist.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from fastapi import Request

from ragkv.api.errors import ApiError
from ragkv.app.request_types import check_tenant
from ragkv.ingest.errors import InputError

DEFAULT_TENANT = "default"
ENV_VAR = "RAGKV_API_KEYS"


def load_api_keys(path: Path | None, env: str | None = None) -> dict[str, str]:
    """key -> tenant from the file and the environment variable (ValueError when malformed)."""
    keys: dict[str, str] = {}
    if path is not None:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"API keys file {path} does not exist") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"API keys file {path} is not valid JSON: {error}") from None
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"API keys file {path} must be a JSON object mapping key -> tenant")
        keys.update(data)
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


class Authenticator:
    def __init__(self, keys: dict[str, str]):
        # Compare digests in constant time; never keep a key around longer than needed.
        self._digests = [(hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in keys.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self._digests}

    def tenant_for(self, authorization: str | None) -> str:
        if not self._digests:
            return DEFAULT_TENANT
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
        for candidate, tenant in self._digests:
            if hmac.compare_digest(candidate, digest):
                found = tenant
        if found is None:
            raise ApiError(401, "invalid_api_key", "the API key is not valid", headers={"WWW-Authenticate": "Bearer"})
        return found


def tenant_of(request: Request) -> str:
    """The tenant the middleware found for the request's API key."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:  # a route outside /v1/: authenticate here
        tenant = request.app.state.authenticator.tenant_for(request.headers.get("authorization"))
    return tenant
