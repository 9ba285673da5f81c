"""A TCP proxy on 127.0.0.1 in front of the S3 endpoint that can stop answering and resume.

While paused it still accepts connections but moves no byte in either direction, which is what
a stalled network path looks like to a client: requests hang until the client's read timeout,
then are retried. On resume, what was held flows on. It runs its own event loop in a thread so
the process that controls it (the chaos run's driver) can pause and resume it at will.
"""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urlsplit

from islands.infra.process import LOOPBACK

CHUNK = 1 << 16


class S3Proxy:
    def __init__(self, upstream_url: str):
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname or LOOPBACK, parts.port or 80)
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="s3-proxy", daemon=True)
        self.port: int | None = None
        self.held = 0  # connections and transfers that had to wait for a stall to end

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> str:
        """Listen on a free loopback port; returns the URL clients should use."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self.url

    async def _listen(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if not self._open.is_set():  # moto's server closes after each response: most requests come here
            self.held += 1
            await self._open.wait()
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(self._pipe(client_r, up_w), self._pipe(up_r, client_w))
        except asyncio.CancelledError:
            pass  # the proxy is shutting down; the connection closes with it

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK):
                if not self._open.is_set():
                    self.held += 1
                    await self._open.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def pause(self) -> None:
        """Stop moving bytes (connections are still accepted and held)."""
        self._loop.call_soon_threadsafe(self._open.clear)

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def stall(self, at_s: float, for_s: float) -> None:
        """Pause `at_s` seconds from now, for `for_s` seconds."""
        self._loop.call_soon_threadsafe(self._loop.call_later, at_s, self._open.clear)
        self._loop.call_soon_threadsafe(self._loop.call_later, at_s + for_s, self._open.set)

    def stop(self) -> None:
        """Close the listener and every held connection, then end the loop's thread."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> S3Proxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
