"""The session id a client names, checked at the API's edge, the session side of a chat
turn's answer (chat completions and responses), and the wait that lets an answer end only
once its context can be continued on another replica (the store itself is
ragkv.app.chat.session_store)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from ragkv.api.common.serving import citations_of
from ragkv.api.errors import ApiError
from ragkv.api.sources import sources_block
from ragkv.app.chat.contexts import ContextStore, new_context_id
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


@dataclass
class ChatTurnAnswer:
    """Which id a chat turn's context is kept under, and what its answer awaits and adds."""

    session_id: str
    named: str | None
    """The session the client named; None: the turn continues the longest cached prefix."""
    sessions: ContextStore
    tenant: str
    wait_s: float
    with_sources: bool = False
    """End the answer's text with the sources block (`sources: true`)."""

    @classmethod
    def of(
        cls, top_level: str | None, in_rag: str | None, sessions: ContextStore, tenant: str, wait_s: float, **options
    ) -> ChatTurnAnswer:
        """From the request's `session_id` and `rag.session_id` (the same, when both are given)."""
        if top_level and in_rag and top_level != in_rag:
            raise ApiError(400, "conflicting_session_id", "session_id and rag.session_id differ", param="session_id")
        named = top_level or in_rag
        session_id = check_session_id(named) if named else new_context_id()
        return cls(session_id, session_id if named else None, sessions, tenant, wait_s, **options)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Session-Id": self.session_id}

    async def settle(self, outcome: RequestOutput) -> None:
        """The context reaches other replicas before the answer ends."""
        await settle_shared(self.sessions, self.tenant, self.session_id, outcome, self.wait_s)

    def sources(self, outcome: RequestOutput) -> str:
        return sources_block(citations_of(outcome.citations), self.session_id)
