"""The host's services as the test hosts reach them: moto's S3 server on each host-side address, and a TCP
forwarder from each host-side address to PostgreSQL on loopback.

Why a forwarder: the workers' connections then reach PostgreSQL from 127.0.0.1, so the server's loopback trust in
pg_hba applies and nothing in PostgreSQL's configuration changes (listen_addresses stays loopback). It is asyncio,
standard library only, and runs in a thread of the test process; cutting a test host's link stalls that host's
connections in the middle of the path, as a network fault would.

moto keeps its buckets in process-global state, so the servers started here (one per address, plus one on
127.0.0.1 for the host's reconciler and survey) serve one store.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

from s3_support import start_s3_server, stop_s3_server

POSTGRES = ("127.0.0.1", 5432)


def start_s3_servers(addresses: Iterable[str]) -> dict[str, tuple[object, str]]:
    """One moto server (``s3_support.MotoServer``) bound to each address on a port the OS picks; moto's backend is one
    per process, so every address serves the same buckets. ``{address: (server, endpoint)}``."""
    servers: dict[str, tuple[object, str]] = {}
    try:
        for address in addresses:
            servers[address] = start_s3_server(address)
    except BaseException:
        stop_s3_servers(servers)
        raise
    return servers


def stop_s3_servers(servers: dict[str, tuple[object, str]]) -> list[str]:
    errors = []
    for address, (server, _) in list(servers.items()):
        try:
            stop_s3_server(server)
        except Exception as exc:  # teardown goes on: every other server still has to stop
            errors.append(f"moto on {address}: {type(exc).__name__}: {exc}")
        servers.pop(address, None)
    return errors


class TcpForwarder:
    """Listens on each of ``addresses`` (a port the OS picks per address) and pipes every connection to ``target``.

    Example:
        forwarder = TcpForwarder(["10.231.40.1"]).start()
        port = forwarder.ports["10.231.40.1"]
        ...
        forwarder.stop()
    """

    def __init__(self, addresses: Iterable[str], target: tuple[str, int] = POSTGRES) -> None:
        self.addresses = list(addresses)
        self.target = target
        self.ports: dict[str, int] = {}
        self.accepted = 0
        self.failed_upstream = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pg-forwarder", daemon=True)
        self._servers: list[asyncio.base_events.Server] = []
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> TcpForwarder:
        self._thread.start()
        try:
            for address in self.addresses:
                server = asyncio.run_coroutine_threadsafe(
                    asyncio.start_server(self._serve, address, 0), self._loop
                ).result(10)
                self._servers.append(server)
                self.ports[address] = server.sockets[0].getsockname()[1]
        except BaseException:
            self.stop()
            raise
        return self

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.add(client_writer)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self.failed_upstream += 1
            client_writer.close()
            self._writers.discard(client_writer)
            return
        self._writers.add(upstream_writer)
        pumps = [
            asyncio.ensure_future(self._pipe(client_reader, upstream_writer)),
            asyncio.ensure_future(self._pipe(upstream_reader, client_writer)),
        ]
        try:
            # PostgreSQL's protocol never half-closes: when either side ends, the connection is over.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for writer in (client_writer, upstream_writer):
                writer.close()
                self._writers.discard(writer)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass

    def stop(self) -> None:
        """Closes the listeners and every open connection, then stops the loop and joins its thread."""
        if not self._thread.is_alive():
            return

        async def close_all() -> None:
            for server in self._servers:
                server.close()
            for writer in list(self._writers):
                writer.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        try:
            asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()
