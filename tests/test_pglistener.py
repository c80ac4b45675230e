"""The LISTEN/NOTIFY listener against a real PostgreSQL: wakes, fan-out, coalescing, names,
payload limits, the pooled-LISTEN trap, and the component wiring."""

from __future__ import annotations

import warnings

import asyncpg
import pytest
import trio

from pglistener_helpers import metric_value, next_wake, notify_committed, notify_rolled_back, running_listener
from relay_trio.channels import NotifyPayloadTooLarge, check_notify_payload
from relay_trio.db import Database
from relay_trio.pglistener import Wake
from relay_trio.store import listen as listen_ops


@pytest.fixture
def fast_settings(settings_factory):
    return settings_factory(heartbeat_interval=0.5, heartbeat_timeout=2.0)


async def test_committed_notify_wakes_and_rolled_back_does_not(db, database_url, fast_settings):
    async with running_listener(database_url, fast_settings) as listener:
        sub = listener.subscribe("t_commit")
        assert await next_wake(sub) == Wake("t_commit", None, True)  # ready: LISTEN in effect
        await notify_rolled_back(db, "t_commit", "rolled-back")
        await notify_committed(db, "t_commit", "committed")
        assert await next_wake(sub) == Wake("t_commit", "committed", False)
        with pytest.raises(trio.WouldBlock):
            sub.receive_nowait()
        status = listener.status()
        assert status["state"] == "connected"
        assert status["wakes"]["t_commit"] == 2
        assert status["heartbeat_rtt_ms"] is not None


async def test_fan_out_to_four_subscribers(db, database_url, fast_settings):
    async with running_listener(database_url, fast_settings) as listener:
        subs = [listener.subscribe("t_fan") for _ in range(4)]
        for sub in subs:
            assert (await next_wake(sub)).reconnect
        await notify_committed(db, "t_fan", "hello")
        for sub in subs:
            assert await next_wake(sub) == Wake("t_fan", "hello", False)
        assert metric_value(listener.metrics, "relay_listener_wakes_total", {"channel": "t_fan"}) == 8


async def test_burst_of_30_commits_never_loses_the_final_wake(db, database_url, fast_settings):
    async with running_listener(database_url, fast_settings) as listener:
        sub = listener.subscribe("t_burst", buffer=4)
        assert (await next_wake(sub)).reconnect
        for i in range(30):
            await notify_committed(db, "t_burst", str(i))
        # Wait until the listener has pushed all 30 (without the subscriber reading any).
        with trio.fail_after(10):
            while listener.status()["wakes"].get("t_burst", 0) < 31:
                await trio.sleep(0.01)
        got = []
        while True:
            try:
                got.append(sub.receive_nowait().payload)
            except trio.WouldBlock:
                break
        # A full buffer coalesces into one pending wake (never raises, never blocks), so a
        # slow subscriber sees buffer + 1 wakes, not 30; the merged one covers "4".."29"
        # (payload None: "look at everything"), so the final wake is never lost.
        assert got == ["0", "1", "2", "3", None], got
        assert sub.coalesced == 26


async def test_late_subscriber_on_a_new_channel_is_listened_and_woken(db, database_url, fast_settings):
    async with running_listener(database_url, fast_settings) as listener:
        first = listener.subscribe("t_early")
        assert (await next_wake(first)).reconnect
        late = listener.subscribe("t_late")  # after run() started: LISTENed on the live connection
        assert await next_wake(late) == Wake("t_late", None, True)
        assert "t_late" in await listener.listening_channels()
        await notify_committed(db, "t_late", "p")
        assert await next_wake(late) == Wake("t_late", "p", False)
        # A second subscriber on an already-LISTENed channel is ready at once.
        again = listener.subscribe("t_late")
        assert again.receive_nowait() == Wake("t_late", None, True)
        again.close()
        assert [w async for w in again] == []


async def test_channel_names_are_quoted_and_length_checked(db, database_url, fast_settings):
    async with running_listener(database_url, fast_settings) as listener:
        with pytest.raises(ValueError):
            listener.subscribe("x" * 64)
        with pytest.raises(ValueError):
            listener.subscribe("é" * 32)  # 64 bytes, 32 characters
        with pytest.raises(ValueError):
            listener.subscribe(listener.heartbeat_channel)
        odd = 'we"ird; chan -- ' + "x" * 47  # 63 bytes, quotes and spaces
        assert len(odd.encode()) == 63
        sub = listener.subscribe(odd)
        assert (await next_wake(sub)).reconnect
        await notify_committed(db, odd, "ok")
        assert await next_wake(sub) == Wake(odd, "ok", False)


def test_check_notify_payload_limits():
    check_notify_payload("c", "x" * 7999)
    check_notify_payload("c", None)
    with pytest.raises(NotifyPayloadTooLarge, match="8000 bytes"):
        check_notify_payload("c", "x" * 8000)
    with pytest.raises(NotifyPayloadTooLarge):
        check_notify_payload("c", "é" * 4000)  # 4000 characters, 8000 bytes
    with pytest.raises(ValueError):
        check_notify_payload("c" * 64, "x")


async def test_oversized_payload_is_refused_before_it_reaches_the_server(db, database_url, fast_settings):
    async def op(conn):
        with pytest.raises(NotifyPayloadTooLarge):
            await listen_ops.notify(conn, "t_big", "x" * 8000)
        # The transaction is still usable: the server never saw the statement (its own
        # refusal, SQLSTATE 22023, would have aborted the transaction).
        return await conn.fetchval("SELECT 1")

    assert await db.run_tx(op) == 1
    async with running_listener(database_url, fast_settings) as listener:
        with pytest.raises(NotifyPayloadTooLarge):
            await listener.notify("t_big", "y" * 8000)
        await listener.notify("t_big", "y" * 7999)  # the limit itself is accepted


async def test_listen_on_a_pooled_connection_is_lost_after_release(aio_loop, database_url):
    """Pins why the listener needs its own connection outside the pool."""
    pool = await Database.connect(database_url, min_size=1, max_size=1)
    got = []
    try:

        async def listen_on_pooled(conn):
            await conn.add_listener("t_pooled", lambda *args: got.append(args))
            return conn.get_server_pid(), await listen_ops.listening_channels(conn)

        async def inspect(conn):
            return conn.get_server_pid(), await listen_ops.listening_channels(conn)

        with warnings.catch_warnings():
            # asyncpg warns that the released connection had an active listener.
            warnings.simplefilter("ignore", asyncpg.InterfaceWarning)
            pid1, before = await pool.run(listen_on_pooled)
        assert before == ["t_pooled"]
        pid2, after = await pool.run(inspect)  # max_size=1: the same connection, after a release
        assert pid1 == pid2
        assert after == [], (
            "a LISTEN now survives asyncpg's pool release: the reason for the listener's "
            "dedicated connection changed; revisit relay_trio.pglistener"
        )
        await pool.run_tx(listen_ops.notify, "t_pooled", "lost")
        await pool.run(inspect)
        await trio.sleep(0.1)
        assert got == []
    finally:
        await pool.close()


async def test_component_runs_first_in_the_pod_and_reports_in_readyz(pod_factory):
    import httpx

    from relay_trio.service import components

    pod = await pod_factory(heartbeat_interval=0.5)
    assert [name for name, _ in components(pod)][0] == "pglistener"
    assert pod.pglistener is not None
    assert pod.pglistener.application_name == f"relay-listener:{pod.pod_id}"[:63]
    assert pod.tasks_alive["pglistener"] is True
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        ready = (await client.get("/readyz")).json()
    assert ready["listener"]["state"] == "connected"
    assert metric_value(pod.metrics, "relay_listener_state", {"state": "connected"}) == 1
    assert metric_value(pod.metrics, "relay_listener_state", {"state": "degraded"}) == 0


async def test_component_disabled_sets_nothing(pod_factory):
    pod = await pod_factory(listen_enabled=False)
    assert pod.pglistener is None
    assert pod.tasks_alive["pglistener"] is True


async def test_concurrent_heartbeats_late_listens_and_notifies_share_the_connection(db, database_url, settings_factory):
    settings = settings_factory(heartbeat_interval=0.005, heartbeat_timeout=2.0)
    async with running_listener(database_url, settings) as listener:
        subs = []
        async with trio.open_nursery() as nursery:
            for i in range(15):
                subs.append(listener.subscribe(f"t_many_{i}"))
                nursery.start_soon(listener.notify, "t_other", str(i))
                await trio.sleep(0.003)
        for sub in subs:
            assert (await next_wake(sub)).reconnect
        # asyncpg allows one operation at a time: overlapping ones must queue, not reconnect.
        assert listener.status()["reconnects"] == 0
        assert listener.status()["state"] == "connected"
