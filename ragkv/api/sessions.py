"""The session id a client names, checked at the API's edge, and the wait that lets an
answer end only once its context can be continued on another replica (the store itself is
ragkv.app.session_store)."""

from __future__ import annotations

import asyncio
import re

from ragkv.api.errors import ApiError
from ragkv.app.contexts import ContextStore
from ragkv.app.request import RequestOutput

_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not _SESSION_ID.match(session_id):
        raise ApiError(
            400, "bad_session_id", "session_id must be 1-128 characters of [A-Za-z0-9_.:-]", param="session_id"
        )
    return session_id


async def settle_shared(
    sessions: ContextStore, tenant: str, session_id: str, outcome: RequestOutput, wait_s: float
) -> None:
    """Wait (at most `wait_s`) until the anonymous context the turn left is published for
    other replicas, and say in the answer's `session.shared` whether it is: an answer whose
    last event a client has read names an id, and a prefix, that any replica sharing the
    session store continues. A named session was written to the store by the turn itself."""
    published = sessions.publication(tenant, session_id)
    if published is None:
        return
    if wait_s > 0:
        try:  # shielded: a timeout must not cancel the publisher's future
            shared = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(published)), wait_s)
        except TimeoutError:
            shared = False
    else:
        shared = published.done() and published.result()
    session = getattr(outcome.info, "session", None)
    if session:
        session["shared"] = shared
