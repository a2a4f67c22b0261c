"""Citations in the answer text, for clients that read only the message (LangChain, UIs).

With `sources: true` a chat answer ends with numbered markers and a sources block:

    Gull Point Light was first lit in 1871. [1][2]

    Sources:
    [1] lighthouses.md, chunk 0 (doc_3f2a...)
    [2] observatory.md, chunk 0 (doc_91bc...)

    Session: sess_...

Marker n is the n-th entry of the response's `rag.citations` (most relevant first). The
session line lets a client that sees only the text continue the session (`session_id`).
The block is not part of the session: the next turn re-reads the answer without it.
"""

from __future__ import annotations

from ragkv.api.common.protocol import Citation


def sources_block(citations: list[Citation], session_id: str) -> str:
    if not citations:
        return f"\n\nSources: none\n\nSession: {session_id}"
    markers = "".join(f"[{number}]" for number in range(1, len(citations) + 1))
    lines = [f"[{number}] {c.name}, chunk {c.chunk_index} ({c.document_id})" for number, c in enumerate(citations, 1)]
    return f" {markers}\n\nSources:\n" + "\n".join(lines) + f"\n\nSession: {session_id}"
