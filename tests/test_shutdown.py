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


class FakeDb:
    def __init__(self, log: list):
        self.log = log

    async def run_tx(self, op, *args, timeout=None):
        self.log.append(("release_leases", op.__name__, *args))
        return 0


class FakePod:
    def __init__(self, log: list, grace: float = 10.0):
        self.settings = make_settings("postgresql://unused/x", shutdown_grace=grace)
        self.delivery = None
        self.pod_id = "pod-x"
        self.db = FakeDb(log)


async def test_order_http_drain_then_delivery_grace(autojump_clock):
    log: list = []
    http_done = trio.Event()
    pod = FakePod(log, grace=10.0)
    pod.delivery = FakeDelivery(log, http_done, takes=3.0)

    async def http_drains():
        await trio.sleep(0.5)
        log.append(("http.done",))
        http_done.set()

    async with trio.open_nursery() as n:
        n.start_soon(http_drains)
        woken = await graceful_shutdown(pod, http_done)
    assert log == [
        ("http.done",),
        ("delivery.shutdown", 10.0, True),
        ("delivery.done",),
        ("release_leases", "release_pod_leases", "pod-x", True),  # release + wake other pods
    ]
    assert woken is True


async def test_a_delivery_shutdown_that_overruns_the_grace_is_cut_off(autojump_clock):
    log: list = []
    http_done = trio.Event()
    http_done.set()
    pod = FakePod(log, grace=2.0)
    pod.delivery = FakeDelivery(log, http_done, takes=3600.0)
    t0 = trio.current_time()
    woken = await graceful_shutdown(pod, http_done)
    assert trio.current_time() - t0 <= 2.0 + 1.0 + 0.01
    # no release while the cut-off delivery may still run: run_pod releases after cancelling it
    assert log == [("delivery.shutdown", 2.0, True)]
    assert woken is False


# -- real processes: a rolling restart loses nothing and delays nothing -----------------------
def _fetch(dsn: str, query: str):
    import asyncio as _asyncio

    import asyncpg

    async def main():
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetch(query)
        finally:
            await conn.close()

    return _asyncio.run(main())


@pytest.mark.timeout(180)
def test_sigterm_releases_in_flight_rows_to_the_other_pod_at_once(database_url, tmp_path):
    import signal
    import time

    from proc_helpers import ADMIN_TOKEN, INGEST_TOKEN, PodProcess, RecordingListener, auth, http_json, wait_until

    n_events = 4  # within one listener's share of A's in-flight slots (max_in_flight 10 x 0.5)
    common = dict(ingest_tokens=INGEST_TOKEN, admin_token=ADMIN_TOKEN, lease_seconds=30, poll_max=2.0)
    # The listener holds pod A's attempts far longer than the test (A's attempt deadline
    # is raised to match), so they are in flight when A gets SIGTERM.
    with RecordingListener(delay=60.0) as hook:
        pod_a = PodProcess(database_url, tmp_path / "a.log", pod_id="pod-a", shutdown_grace=0.5,
                           delivery_timeout=90, **common).start()
        # B's poll is slowed to 20-30 s: only A's lease release plus its wake NOTIFY can
        # explain B claiming the rows within a second (A's leases run 30 s).
        pod_b = PodProcess(database_url, tmp_path / "b.log", pod_id="pod-b", **dict(common, poll_min=20, poll_max=30))
        try:
            pod_a.wait_ready()
            status, body = http_json("PUT", pod_a.base_url + "/listeners/bot", {"url": hook.url}, auth(ADMIN_TOKEN))
            assert status == 201, body
            time.sleep(0.5)  # A's registry cache follows the NOTIFY
            accepted = []
            for i in range(n_events):
                status, body = http_json(
                    "POST", pod_a.base_url + "/events",
                    {"id": f"roll-{i}", "channel": "c", "author": "a", "content": "hi @bot", "mentions": ["bot"]},
                    auth(INGEST_TOKEN),
                )
                assert status == 202, body
                accepted += [d["delivery_id"] for d in body["deliveries"]]
            assert len(accepted) == n_events
            assert hook.wait_for(lambda h: h.started >= n_events, 20), f"only {hook.started} arrived"
            # Pod B starts only now, so every row is in flight on pod A, leased for 30 s.
            pod_b.start().wait_ready()
            leased = _fetch(database_url, "SELECT lease_owner, count(*) AS n FROM deliveries "
                                          "WHERE status = 'pending' GROUP BY lease_owner")
            assert {r["lease_owner"]: r["n"] for r in leased} == {"pod-a": n_events}
            hook.delay = 0.0  # pod B's attempts answer at once
            time.sleep(0.5)  # B is idle: its poll backs off toward the 2 s ceiling

            t_term = time.monotonic()
            pod_a.signal(signal.SIGTERM)
            assert pod_a.wait_exit(30) == 0
            t_exit = time.monotonic()
            assert hook.wait_for(lambda h: h.started >= 2 * n_events, 20), "pod B never got the released rows"
            second = [r for r in hook.arrivals_snapshot() if r.arrived > t_term]
            assert sorted(int(r.headers["webhook-id"]) for r in second) == sorted(accepted)

            def all_delivered() -> bool:
                rows = _fetch(database_url, "SELECT status FROM deliveries")
                return len(rows) == n_events and all(r["status"] == "delivered" for r in rows)

            wait_until(all_delivered, 20, what="every accepted row delivered")
            by = _fetch(database_url, "SELECT DISTINCT pod_id FROM delivery_attempts WHERE outcome = 'delivered'")
            assert [r["pod_id"] for r in by] == ["pod-b"]
            via = [r["claimed_via"] for r in _fetch(database_url, "SELECT claimed_via FROM deliveries")]
            assert via == ["notify"] * n_events
        finally:
            pod_a.stop()
            pod_b.stop()

    shutdown = t_exit - t_term
    handover = max(r.arrived for r in second) - t_term
    print(f"\npod A shutdown {shutdown:.2f}s (grace 0.5s); last released row reached pod B's listener "
          f"{handover * 1000:.0f} ms after SIGTERM; pod B claimed them via {via}")
    # A's lease was 30 s, B's poll 20 s: the grace (0.5 s) plus release and wake beat both.
    assert shutdown < 8.0
    assert handover < 0.5 + 1.5, f"released rows took {handover:.2f}s after SIGTERM to reach pod B"
