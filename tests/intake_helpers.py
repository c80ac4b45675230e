"""Helpers shared by the intake / listener / notifier tests (not a test module)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from conftest import make_settings
from relay_trio.db import connect_dedicated, on_connection
from relay_trio.intake import parse_event
from relay_trio.runtime import Pod
from relay_trio.store.listeners import upsert_listener
from relay_trio.web.listeners import generate_secret, generate_stream_token


def bare_pod(db, database_url: str, **overrides) -> Pod:
    """A Pod with no components running: nothing consumes its hand-off channel."""
    return Pod.create(make_settings(database_url, **overrides), db)


async def add_listener(db, name: str, url: str = "http://127.0.0.1:9/hook", enabled: bool = True) -> None:
    _, token_hash = generate_stream_token()
    await db.run(upsert_listener, name, url, generate_secret(), False, enabled, token_hash)


def event(**fields):
    body = {"channel": "general", "author": "alice", "content": "hi"}
    body.update(fields)
    return parse_event(body)


async def fetch(db, query: str, *args):
    async def op(conn):
        return await conn.fetch(query, *args)

    return await db.run(op)


async def fetchval(db, query: str, *args):
    async def op(conn):
        return await conn.fetchval(query, *args)

    return await db.run(op)


async def execute(db, query: str, *args):
    async def op(conn):
        return await conn.execute(query, *args)

    return await db.run(op)


def drain(recv: trio.MemoryReceiveChannel) -> list[int]:
    out = []
    while True:
        try:
            out.append(recv.receive_nowait())
        except trio.WouldBlock:
            return out


class RecordingNotifier:
    """Stands in for pod.notifier where a test only checks what intake asked for."""

    def __init__(self):
        self.requests: list[tuple[str, str | None]] = []

    def request(self, channel: str, hint: str | None = None) -> None:
        self.requests.append((channel, hint))


@asynccontextmanager
async def listening(dsn: str, *channel_names: str):
    """A dedicated LISTEN connection; yields the list that collects (channel, payload)."""
    got: list[tuple[str, str]] = []

    def callback(_conn, _pid, channel, payload):
        got.append((channel, payload))

    conn = await connect_dedicated(dsn, "relay-test-listen")

    async def subscribe(c):
        for ch in channel_names:
            await c.add_listener(ch, callback)

    await on_connection(conn, subscribe)
    try:
        yield got
    finally:
        with trio.CancelScope(shield=True):
            await on_connection(conn, lambda c: c.close())


async def wait_until(predicate, timeout: float = 10.0, step: float = 0.01) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(step)
