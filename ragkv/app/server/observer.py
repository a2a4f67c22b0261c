"""What the engine client reports while it serves: the HTTP server's metrics listen, the
CLI does not. Every hook is called on the model worker's thread and must not block."""

from __future__ import annotations

from ragkv.app.request import Request, RequestOutput
from ragkv.app.server.request_stream import RequestStream
from ragkv.app.server.task import Task


class ServerObserver:
    """Hooks with nothing to do; a front end that records figures overrides them."""

    def task_ended(self, task: Task) -> None:
        """A task (deletion, embeddings, ingestion) ended; `task.outcome` says how."""

    def stream_ended(self, stream: RequestStream) -> None:
        """Every request of a stream ended; `stream.outcome` says how."""

    def request_finished(self, request: Request, output: RequestOutput) -> None:
        """A request finished with its output (`request.kind`: query, chat or completion)."""

    def fidelity_measured(self, strategy: str, kl: float) -> None:
        """A live fidelity sample's first-token KL(full || fused), in nats."""

    def fidelity_dropped(self) -> None:
        """A live fidelity sample was given up."""
