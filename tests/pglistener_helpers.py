"""Helpers shared by the pglistener tests (not a test module)."""

from __future__ import annotations

import urllib.parse
from contextlib import asynccontextmanager

import trio

from relay_trio.metrics import Metrics
from relay_trio.pglistener import PgListener, Subscription, Wake
from relay_trio.store import listen as listen_ops


async def next_wake(sub: Subscription, timeout: float = 10.0) -> Wake:
    with trio.fail_after(timeout):
        return await sub.receive()


@asynccontextmanager
async def running_listener(dsn: str, settings, metrics: Metrics | None = None):
    listener = PgListener(dsn, settings.pod_id, settings, metrics or Metrics())
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        try:
            yield listener
        finally:
            nursery.cancel_scope.cancel()


async def notify_committed(db, channel: str, payload: str) -> None:
    await db.run_tx(listen_ops.notify, channel, payload)


class Rollback(Exception):
    pass


async def notify_rolled_back(db, channel: str, payload: str) -> None:
    async def op(conn):
        await listen_ops.notify(conn, channel, payload)
        raise Rollback

    try:
        await db.run_tx(op)
    except Rollback:
        pass


async def backend_pids(db, application_name: str) -> list[int]:
    async def op(conn):
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 ORDER BY backend_start", application_name
        )
        return [r["pid"] for r in rows]

    return await db.run(op)


async def terminate_backend(db, pid: int) -> bool:
    async def op(conn):
        return await conn.fetchval("SELECT pg_terminate_backend($1)", pid)

    return await db.run(op)


def metric_value(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, labels or {})


class NotificationEatingProxy:
    """A TCP proxy to the test server that can swallow NotificationResponse ('A') messages.

    It stands in for a transaction-pooling proxy, which silently loses LISTEN: queries work,
    notifications never arrive. ``drop`` may be flipped while it runs.
    """

    def __init__(self, upstream_dsn: str, drop: bool = True):
        self.upstream_dsn = upstream_dsn
        self.drop = drop
        self.port: int | None = None

    def dsn(self) -> str:
        parts = urllib.parse.urlsplit(self.upstream_dsn)
        user = parts.username or "postgres"
        return f"postgresql://{user}@127.0.0.1:{self.port}{parts.path}?sslmode=disable"

    async def _connect_upstream(self) -> trio.abc.Stream:
        parts = urllib.parse.urlsplit(self.upstream_dsn)
        query = urllib.parse.parse_qs(parts.query)
        port = int(query.get("port", [parts.port or 5432])[0])
        host = query.get("host", [parts.hostname or "127.0.0.1"])[0]
        if host.startswith("/"):
            return await trio.open_unix_socket(f"{host}/.s.PGSQL.{port}")
        return await trio.open_tcp_stream(host, port)

    async def _handle(self, client: trio.SocketStream) -> None:
        try:
            async with client:
                server = await self._connect_upstream()
                async with server, trio.open_nursery() as nursery:

                    async def client_to_server():
                        async for data in client:
                            await server.send_all(data)
                        nursery.cancel_scope.cancel()

                    async def server_to_client():
                        buf = b""
                        async for data in server:
                            buf += data
                            out = bytearray()
                            while len(buf) >= 5:
                                length = int.from_bytes(buf[1:5], "big")
                                if len(buf) < 1 + length:
                                    break
                                msg, buf = buf[: 1 + length], buf[1 + length :]
                                if not (self.drop and msg[:1] == b"A"):
                                    out += msg
                            if out:
                                await client.send_all(bytes(out))
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(client_to_server)
                    nursery.start_soon(server_to_client)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._handle, listeners)
