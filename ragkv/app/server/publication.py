"""The wait that lets a chat answer end only once its context can be continued on another
replica: an answer whose last event a client has read names an id, and a prefix, that any
replica sharing the session store continues."""

from __future__ import annotations

import asyncio

from ragkv.app.chat.contexts import ContextStore
from ragkv.app.request import RequestOutput


async def settle_shared(
    sessions: ContextStore, tenant: str, context_id: str, outcome: RequestOutput, wait_s: float
) -> None:
    """Wait (at most `wait_s`) until the anonymous context the turn left is published for
    other replicas, and say in the outcome's `session["shared"]` whether it is. A named
    session was written to the store by the turn itself."""
    published = sessions.publication(tenant, context_id)
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
