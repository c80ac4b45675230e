"""Graceful shutdown: HTTP drains first (idle keep-alive does not hold it), delivery gets
the grace, every lease this pod holds is released and the other pods are woken."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import trio

from conftest import make_settings
from relay_trio import channels
from relay_trio.db import connect_dedicated, on_connection
from relay_trio.service import graceful_shutdown, run_pod
from relay_trio.web import health


class RunningPod:
    """run_pod in the test's nursery, with a handle on when it has fully returned."""

    def __init__(self, nursery: trio.Nursery):
        self.nursery = nursery
        self.finished = trio.Event()
        self.pod = None

    async def start(self, settings):
        async def body(task_status=trio.TASK_STATUS_IGNORED):
            try:
                await run_pod(settings, settings.database_url, task_status=task_status)
            finally:
                self.finished.set()

        self.pod = await self.nursery.start(body)
        return self.pod

    async def shutdown(self, within: float) -> float:
        t0 = trio.current_time()
        self.pod.shutting_down.set()
        with trio.fail_after(within):
            await self.finished.wait()
        return trio.current_time() - t0


async def test_idle_keepalive_connection_does_not_hold_shutdown(database_url, nursery):
    # HTTP drain would be min(grace, db_timeout + 1) = 6 s if an idle connection held it.
    running = RunningPod(nursery)
    pod = await running.start(make_settings(database_url, shutdown_grace=8.0, db_timeout=5.0))
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        assert (await client.get("/healthz")).status_code == 200  # connection now idle, kept alive
        took = await running.shutdown(within=15)
    assert took < 3.0, f"shutdown took {took:.2f}s with an idle keep-alive connection open"


async def test_in_flight_request_finishes_and_new_connections_are_refused(database_url, nursery, monkeypatch):
    entered = []

    async def slow_pending_migrations(conn):  # asyncio side, like the real one
        entered.append(True)
        await asyncio.sleep(1.5)
        return []

    monkeypatch.setattr(health, "pending_migrations_tx", slow_pending_migrations)
    running = RunningPod(nursery)
    pod = await running.start(make_settings(database_url, shutdown_grace=5.0))
    results: list = []

    async def slow_request():
        async with httpx.AsyncClient(base_url=pod.base_url, timeout=10) as c:
            try:
                results.append((await c.get("/readyz")).status_code)
            except httpx.HTTPError as exc:
                results.append(exc)

    nursery.start_soon(slow_request)
    with trio.fail_after(5):
        while not entered:
            await trio.sleep(0.01)
    pod.shutting_down.set()
    await trio.sleep(0.1)
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=pod.base_url, timeout=2) as c:
            await c.get("/healthz")
    with trio.fail_after(15):
        await running.finished.wait()
    assert len(results) == 1 and isinstance(results[0], int), results  # answered, not dropped


async def _seed_leased_row(conn, owner: str) -> int:
    await conn.execute(
        "INSERT INTO listeners (name, url, secret) VALUES ('bot', 'http://127.0.0.1:9/x', 'whsec_x')"
    )
    seq = await conn.fetchval(
        "INSERT INTO events (id, channel, author, content, body_hash) VALUES ('e1', 'c', 'a', 'x', 'h') RETURNING seq"
    )
    return await conn.fetchval(
        "INSERT INTO deliveries (event_seq, listener, attempts, lease_owner, lease_until, lease_token) "
        "VALUES ($1, 'bot', 1, $2, clock_timestamp() + interval '30 seconds', nextval('fencing_tokens')) RETURNING id",
        seq, owner,
    )


async def test_shutdown_releases_this_pods_leases_and_wakes_other_pods(database_url, db, nursery):
    running = RunningPod(nursery)
    pod = await running.start(make_settings(database_url))
    delivery_id = await db.run_tx(_seed_leased_row, pod.pod_id)
    other_id = await db.run_tx(
        lambda conn: conn.fetchval(
            "INSERT INTO deliveries (event_seq, listener, lease_owner, lease_until, lease_token) "
            "SELECT seq, 'bot', 'another-pod', clock_timestamp() + interval '30 seconds', 1 FROM events RETURNING id"
        )
    )

    heard: list[str] = []
    listen_conn = await connect_dedicated(database_url, "test-listen")

    async def listen(conn):
        await conn.add_listener(channels.OUTBOX, lambda *args: heard.append(args[3]))

    await on_connection(listen_conn, listen)
    try:
        await running.shutdown(within=15)
        with trio.fail_after(5):
            while not heard:
                await trio.sleep(0.02)
    finally:
        await on_connection(listen_conn, lambda conn: conn.close())

    rows = await db.run(
        lambda conn: conn.fetch("SELECT id, lease_owner, lease_until, lease_token FROM deliveries ORDER BY id")
    )
    by_id = {r["id"]: r for r in rows}
    assert by_id[delivery_id]["lease_owner"] is None
    assert by_id[delivery_id]["lease_until"] is None and by_id[delivery_id]["lease_token"] is None
    assert by_id[other_id]["lease_owner"] == "another-pod"  # never another pod's lease
    assert heard == [""]  # one wake for every pod ("any listener")


class FakeDelivery:
    def __init__(self, log: list, http_done: trio.Event, takes: float):
        self.log, self.http_done, self.takes = log, http_done, takes

    async def shutdown(self, grace: float) -> int:
        self.log.append(("delivery.shutdown", grace, self.http_done.is_set()))
        await trio.sleep(self.takes)
        self.log.append(("delivery.done",))
        return 0


class FakePod:
    def __init__(self, delivery=None, grace: float = 10.0):
        self.settings = make_settings("postgresql://unused/x", shutdown_grace=grace)
        self.delivery = delivery


async def test_order_http_drain_then_delivery_grace(autojump_clock):
    log: list = []
    http_done = trio.Event()
    pod = FakePod(grace=10.0)
    pod.delivery = FakeDelivery(log, http_done, takes=3.0)

    async def http_drains():
        await trio.sleep(0.5)
        log.append(("http.done",))
        http_done.set()

    async with trio.open_nursery() as n:
        n.start_soon(http_drains)
        await graceful_shutdown(pod, http_done)
    assert log == [("http.done",), ("delivery.shutdown", 10.0, True), ("delivery.done",)]


async def test_a_delivery_shutdown_that_overruns_the_grace_is_cut_off(autojump_clock):
    log: list = []
    http_done = trio.Event()
    http_done.set()
    pod = FakePod(grace=2.0)
    pod.delivery = FakeDelivery(log, http_done, takes=3600.0)
    t0 = trio.current_time()
    await graceful_shutdown(pod, http_done)
    assert trio.current_time() - t0 <= 2.0 + 1.0 + 0.01
    assert log == [("delivery.shutdown", 2.0, True)]
