"""The wait that lets a chat answer end only once its context can be continued on another
replica: an answer whose last event a client has read names an id, and a prefix, that any
replica sharing the session store continues."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from ragkv.app.chat.contexts import ContextStore
from ragkv.app.request import RequestOutput


async def settle_shared(
    sessions: ContextStore, tenant: str, context_id: str, outcome: RequestOutput, wait_s: float
) -> None:
    """Wait (at most `wait_s`) until the context the turn left is published for other
    replicas (a named session was written when the turn released it; an anonymous one is
    published in the background), and say in the outcome's `session["shared"]`, its one
    writer, whether it is."""
    published = sessions.publication(tenant, context_id)
    session = getattr(outcome.info, "session", None)
    if session:
        session["shared"] = await _settled(published, wait_s)


async def _settled(published: Future[bool] | None, wait_s: float) -> bool:
    if published is None:
        return False  # nothing is published from process memory
    if wait_s <= 0:
        return published.done() and published.result()
    try:  # shielded: a timeout must not cancel the publisher's future
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(published)), wait_s)
    except TimeoutError:
        return False
