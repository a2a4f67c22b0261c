"""A TCP proxy on loopback that delays every reply: a Redis tier across a network, for the
benchmarks, without `tc` (which needs root and the netem module).

Each read from the server side is held `delay_s` before it is forwarded, so every request
and response round trip (a GET of a chunk, a pipeline of them) costs at least that much more;
the client side is forwarded at once.
"""

from __future__ import annotations

import asyncio
import socket
import threading

from ragkv.api.launcher import free_port


class LatencyProxy:
    """`start()` listens on a free port (`port`) and forwards to `target_port` on 127.0.0.1."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="latency-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LatencyProxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, "127.0.0.1", self.port), self._loop
        )
        self._server = future.result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        for side in (writer, upstream_writer):  # Nagle's wait would add to the delay asked for
            side.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(_pipe(reader, upstream_writer, 0.0), _pipe(upstream_reader, writer, self.delay_s))
        except (OSError, asyncio.CancelledError):  # either side went away, or the proxy stops
            upstream_writer.close()
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Forward `reader` to `writer`, each piece `delay_s` after it arrived: a link's latency,
    not a per-piece toll, so a blob that arrives in many reads is late once."""
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        try:
            while data := await reader.read(1 << 20):
                pieces.put_nowait((loop.time() + delay_s, data))
        finally:
            pieces.put_nowait((loop.time() + delay_s, b""))

    receiving = asyncio.ensure_future(receive())
    try:
        while True:
            due, data = await pieces.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    finally:
        receiving.cancel()
        writer.close()
