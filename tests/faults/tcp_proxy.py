"""A small fault-injecting TCP proxy for the network scenarios: listens on loopback, forwards to one
upstream, and on demand adds latency, resets connections or stalls (keeps connections open and forwards
nothing). It runs its own event loop on a thread, so a blocking test can switch modes at any time.

    with FaultProxy("127.0.0.1:50052") as proxy:     # proxy.address -> give this to the client
        proxy.latency_s = 0.05                        # every chunk, both ways, 50 ms later
        proxy.reset_all()                             # RST every open connection (SO_LINGER 0)
        proxy.stalled = True                          # forward nothing until set back to False
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from typing import Any


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.latency_s = 0.0
        self.stalled = False
        self.reset_after_bytes: int | None = None
        """Reset each connection once it has carried this many bytes (both ways), if set."""
        self.resets = 0
        self.connections = 0
        self.address = ""
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        assert self._ready.wait(10), "proxy did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def reset_all(self) -> None:
        """Aborts every open connection with a TCP RST."""
        asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop).result(10)

    # --- the loop -----------------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()
        server.close()
        for writer in list(self._writers):
            self._abort(writer)
        self._loop.run_until_complete(asyncio.sleep(0))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            self._abort(writer)
            return
        pair = {writer, up_writer}
        self._writers |= pair
        carried = [0]
        await asyncio.gather(
            self._pipe(reader, up_writer, pair, carried), self._pipe(up_reader, writer, pair, carried)
        )
        self._writers -= pair

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pair: set[asyncio.StreamWriter],
        carried: list[int],
    ) -> None:
        with contextlib.suppress(OSError, ConnectionError, asyncio.IncompleteReadError):
            while not writer.is_closing():
                while self.stalled:
                    await asyncio.sleep(0.05)
                data = await reader.read(65536)
                if not data:
                    break
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                carried[0] += len(data)
                if self.reset_after_bytes is not None and carried[0] > self.reset_after_bytes:
                    self.resets += 1
                    break
                writer.write(data)
                await writer.drain()
        for w in pair:
            self._abort(w)

    async def _reset_all(self) -> None:
        for writer in list(self._writers):
            self._abort(writer)
        self.resets += 1

    def _abort(self, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
