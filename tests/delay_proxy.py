"""A TCP proxy that delays every reply: a server far away (or a slow one) for tests and
benchmarks. Client bytes go to the server at once; each chunk the server sends back reaches
the client `delay_ms` after it arrived (order kept, nothing merged or dropped).

    proxy = DelayProxy("127.0.0.1", server_port, delay_ms=100).start()
    ... connect to proxy.port ...
    proxy.stop()

Also `python -m tests.delay_proxy SERVER_PORT DELAY_MS` (prints its port, runs until killed).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time


class DelayProxy:
    def __init__(self, host: str, port: int, delay_ms: float) -> None:
        self.target = (host, port)
        self.delay = delay_ms / 1000
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None

    def start(self) -> DelayProxy:
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delaying proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stopping.wait()
            server.close()

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def upstream() -> None:
            while data := await client_r.read(1 << 16):
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def downstream_read() -> None:
            while data := await server_r.read(1 << 16):
                queue.put_nowait((time.monotonic() + self.delay, data))
            queue.put_nowait(None)

        async def downstream_write() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        tasks = [asyncio.ensure_future(t()) for t in (upstream, downstream_read, downstream_write)]
        try:
            await asyncio.gather(*tasks)
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            for task in tasks:
                task.cancel()
            client_w.close()
            server_w.close()


def main() -> None:
    proxy = DelayProxy("127.0.0.1", int(sys.argv[1]), float(sys.argv[2])).start()
    print(proxy.port, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
