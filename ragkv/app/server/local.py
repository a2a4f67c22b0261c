"""The engine client in this process, for a front end without an event loop (the CLI).

`LocalClient` starts the same `EngineClient` the HTTP server runs (its model thread, its
worker loop, its scheduler) on an asyncio runner of its own, and answers each call once
the work is done: no HTTP, no second path to the model. Used as a context manager: the
model loads on enter, the worker stops and everything closes on exit.

    with LocalClient(ServerConfig(runtime=...), read_only=True) as client:
        answer = client.query("Who?", "default", QueryConfig())
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from ragkv.app.query import Answer
from ragkv.app.rag import QueryConfig
from ragkv.app.request import RequestOutput
from ragkv.app.server.client import EngineClient
from ragkv.app.server.config import ServerConfig
from ragkv.app.server.documents import IngestedDocument, Ingestion
from ragkv.app.server.request_stream import RequestStream
from ragkv.app.server.task import Task
from ragkv.engine.generation import GenerationConfig

T = TypeVar("T")


class LocalClient:
    def __init__(self, config: ServerConfig, *, read_only: bool = False):
        """`read_only`: nothing is created or written in the data folder (see EngineClient)."""
        self.config = config
        self.read_only = read_only
        self._runner: asyncio.Runner | None = None
        self._client: EngineClient | None = None

    def __enter__(self) -> LocalClient:
        runner = asyncio.Runner()
        try:
            self._client = runner.run(EngineClient.start(self.config, read_only=self.read_only))
        except BaseException:
            runner.close()
            raise
        self._runner = runner
        return self

    def __exit__(self, *exc_info) -> None:
        runner, client = self._runner, self._client
        self._runner = self._client = None
        if runner is None or client is None:
            return
        try:
            runner.run(client.stop())
        finally:
            runner.close()

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            raise RuntimeError("LocalClient is used inside `with`")
        return self._client

    def _run(self, work: Callable[[EngineClient], Awaitable[T]]) -> T:
        """Run `work(client)` on the runner's event loop (where streams and tasks are made)."""

        async def main() -> T:
            return await work(self.client)

        if self._runner is None:
            raise RuntimeError("LocalClient is used inside `with`")
        return self._runner.run(main())

    # -- what the CLI calls ---------------------------------------------------------------

    def query(self, question: str, tenant: str, config: QueryConfig) -> Answer:
        """A RAG question answered whole (EngineClient.query)."""

        async def answer(client: EngineClient) -> Answer:
            [done] = await _completions(client.query(question, tenant, config))
            return Answer.of(done)

        return self._run(answer)

    def complete(
        self, prompts: Sequence[str | list[int]], generation: GenerationConfig, *, prompt_spans: bool = False
    ) -> list[RequestOutput]:
        """Plain completions of the default tenant, one per prompt, sent together
        (EngineClient.complete)."""
        return self._run(lambda client: _completions(client.complete(prompts, generation, prompt_spans=prompt_spans)))

    def new_document(self, tenant: str, text: str, name: str, **options) -> Ingestion:
        """EngineClient.new_document (replace_same_name, metadata, pages)."""
        return self.client.new_document(tenant, text, name, **options)

    def ingest(self, ingestion: Ingestion, progress: Callable[[int, int], None] | None = None) -> IngestedDocument:
        """Ingest one document to its end (EngineClient.ingest); its errors are raised here."""
        return self._run(lambda client: _result(client.ingest(ingestion, progress)))


async def _completions(stream: RequestStream) -> list:
    """The stream's completions; stopped (and its requests dropped) if the wait is cancelled."""
    try:
        return await stream.wait()
    finally:
        if stream.outcome is None:
            stream.cancel()


async def _result(task: Task):
    try:
        return await task.wait()
    finally:
        if not task.done:
            task.cancel()
