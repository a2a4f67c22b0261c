"""The session id a client names, checked at the API's edge, and the session side of a chat
turn's answer (chat completions and responses): its id and header, the sources block, and
the engine client's wait for the context to reach other replicas before the answer ends
(ragkv.app.server.publication; the store itself is ragkv.app.chat.session_store)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ragkv.api.common.serving import citations_of
from ragkv.api.errors import ApiError
from ragkv.api.sources import sources_block
from ragkv.app.chat.contexts import new_context_id
from ragkv.app.request import RequestOutput
from ragkv.app.server import EngineClient

_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not _SESSION_ID.match(session_id):
        raise ApiError(
            400, "bad_session_id", "session_id must be 1-128 characters of [A-Za-z0-9_.:-]", param="session_id"
        )
    return session_id


@dataclass
class ChatTurnAnswer:
    """Which id a chat turn's context is kept under, and what its answer awaits and adds."""

    session_id: str
    named: str | None
    """The session the client named; None: the turn continues the longest cached prefix."""
    client: EngineClient
    tenant: str
    with_sources: bool = False
    """End the answer's text with the sources block (`sources: true`)."""

    @classmethod
    def of(
        cls, top_level: str | None, in_rag: str | None, client: EngineClient, tenant: str, **options
    ) -> ChatTurnAnswer:
        """From the request's `session_id` and `rag.session_id` (the same, when both are given)."""
        if top_level and in_rag and top_level != in_rag:
            raise ApiError(400, "conflicting_session_id", "session_id and rag.session_id differ", param="session_id")
        named = top_level or in_rag
        session_id = check_session_id(named) if named else new_context_id()
        return cls(session_id, session_id if named else None, client, tenant, **options)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Session-Id": self.session_id}

    async def settle(self, outcome: RequestOutput) -> None:
        """The context reaches other replicas before the answer ends."""
        await self.client.settle_shared(self.tenant, self.session_id, outcome)

    def sources(self, outcome: RequestOutput) -> str:
        return sources_block(citations_of(outcome.citations), self.session_id)
