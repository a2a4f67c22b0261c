"""The session id a client names, checked at the API's edge (the store itself is
ragkv.app.session_store)."""

from __future__ import annotations

import re

from ragkv.api.errors import ApiError

_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not _SESSION_ID.match(session_id):
        raise ApiError(
            400, "bad_session_id", "session_id must be 1-128 characters of [A-Za-z0-9_.:-]", param="session_id"
        )
    return session_id
