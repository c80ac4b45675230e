"""Fault injection on the listener's backend: killed, frozen, and a proxy that swallows
notifications (the silent failures LISTEN-based systems are known for)."""

from __future__ import annotations

import logging
import os
import signal
import socket

import httpx
import pytest
import trio

from pglistener_helpers import (
    NotificationEatingProxy,
    backend_pids,
    metric_value,
    next_wake,
    notify_committed,
    running_listener,
    terminate_backend,
)
from conftest import make_settings
from relay_trio.pglistener import Wake
from relay_trio.service import run_pod


async def test_kill_backend_reconnects_relistens_and_wakes_every_subscriber_once(pod_factory, db):
    pod = await pod_factory(heartbeat_interval=0.5, heartbeat_timeout=2.0)
    listener = pod.pglistener
    subs = [listener.subscribe("t_alpha"), listener.subscribe("t_alpha"), listener.subscribe("t_beta"), listener.subscribe("t_beta")]
    for sub in subs:
        assert await next_wake(sub) == Wake(sub.channel, None, True)
    [old_pid] = await backend_pids(db, listener.application_name)
    assert old_pid == listener.backend_pid

    t0 = trio.current_time()
    assert await terminate_backend(db, old_pid)
    for sub in subs:  # every subscriber of every channel: exactly one reconnect wake ...
        assert await next_wake(sub) == Wake(sub.channel, None, True)
    reconnect_s = trio.current_time() - t0
    [new_pid] = await backend_pids(db, listener.application_name)
    assert new_pid != old_pid and new_pid == listener.backend_pid
    # LISTEN re-issued: a NOTIFY on each channel arrives on the new backend. (The pod runs
    # its own trio-asyncio loop, so pg_listening_channels() is checked in test_pglistener.)
    for channel in ("t_alpha", "t_beta"):
        await notify_committed(db, channel, "after")
    for sub in subs:  # ... and the next wake is the NOTIFY (no second reconnect wake)
        assert await next_wake(sub) == Wake(sub.channel, "after", False)
    status = listener.status()
    assert status["state"] == "connected" and status["reconnects"] == 1
    assert metric_value(pod.metrics, "relay_listener_reconnects_total") == 1
    print(f"terminate -> every subscriber woken after reconnect: {reconnect_s * 1000:.1f} ms")


async def test_frozen_backend_is_detected_by_the_heartbeat_and_replaced(db, database_url, settings_factory):
    settings = settings_factory(heartbeat_interval=0.3, heartbeat_timeout=0.5)
    async with running_listener(database_url, settings) as listener:
        sub = listener.subscribe("t_frozen")
        assert (await next_wake(sub)).reconnect
        pid = listener.backend_pid
        try:
            os.kill(pid, signal.SIGSTOP)
        except PermissionError:
            pytest.skip("cannot signal the server's backends (not root, external server)")
        try:
            t0 = trio.current_time()
            # Still "connected" at the socket level: only the heartbeat can notice.
            assert await next_wake(sub, timeout=15) == Wake("t_frozen", None, True)
            detected_s = trio.current_time() - t0
            assert listener.backend_pid != pid
            assert listener.status()["state"] == "connected"
            assert listener.status()["reconnects"] == 1
            await notify_committed(db, "t_frozen", "alive")
            assert await next_wake(sub) == Wake("t_frozen", "alive", False)
            print(f"SIGSTOP -> replaced connection ready: {detected_s * 1000:.0f} ms "
                  f"(interval {settings.heartbeat_interval}s, timeout {settings.heartbeat_timeout}s)")
        finally:
            os.kill(pid, signal.SIGCONT)


async def test_probe_failure_reports_degraded_once_and_recovers(database_url, caplog):
    caplog.set_level(logging.WARNING, logger="relay_trio.pglistener")
    async with trio.open_nursery() as nursery:
        proxy = await nursery.start(NotificationEatingProxy(database_url, drop=True).serve)
        settings = make_settings(proxy.dsn(), heartbeat_interval=0.3, heartbeat_timeout=0.3)
        pod = await nursery.start(run_pod, settings, settings.database_url)
        listener = pod.pglistener
        assert listener.status()["state"] == "degraded"
        await trio.sleep(1.5)  # several background retries, all failing the probe
        assert listener.status()["state"] == "degraded"
        warnings = [r for r in caplog.records if "self-probe failed" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        assert metric_value(pod.metrics, "relay_listener_state", {"state": "degraded"}) == 1
        async with httpx.AsyncClient(base_url=pod.base_url) as client:
            ready = (await client.get("/readyz")).json()
        assert ready["listener"]["state"] == "degraded"
        assert "poll" in ready["listener_note"]

        sub = listener.subscribe("t_degraded")
        proxy.drop = False  # the proxy is fixed: the background retry must notice
        assert await next_wake(sub, timeout=15) == Wake("t_degraded", None, True)
        assert listener.status()["state"] == "connected"
        pod.shutting_down.set()
        with trio.fail_after(10):
            while listener.status()["state"] != "stopped":
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


async def test_tcp_connection_gets_client_keepalive(aio_loop, database_url, settings_factory):
    settings = settings_factory(heartbeat_interval=0.5, heartbeat_timeout=2.0)
    async with trio.open_nursery() as nursery:
        proxy = await nursery.start(NotificationEatingProxy(database_url, drop=False).serve)
        async with running_listener(proxy.dsn(), settings) as listener:
            sub = listener.subscribe("t_tcp")
            assert (await next_wake(sub)).reconnect
            sock = listener._conn._transport.get_extra_info("socket")
            assert sock.family == socket.AF_INET
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        nursery.cancel_scope.cancel()


async def test_mention_committed_while_the_listener_was_deaf_is_delivered_promptly(pod_factory, db, nursery):
    """Notifications sent while the listener is down are gone; the reconnect wake-all makes
    the delivery loop re-read, so the row goes out at once instead of at the next poll.

    The row is committed with no NOTIFY at all (exactly what a listener that was down sees),
    hand-off is off and the poll is 60 s: only the reconnect wake can deliver it in time.
    """
    from delivery_support import RecordingServer, add_listener, add_rows

    server = RecordingServer()
    hook = await server.start(nursery) + "/hook"
    await add_listener(db, "bot", hook)
    pod = await pod_factory(target_deny_cidrs="", handoff_enabled=False, poll_min=60, poll_max=60,
                            heartbeat_interval=0.5, heartbeat_timeout=2.0)
    await trio.sleep(1.0)  # the start-up poll and the first (connect) wake have found nothing
    [row] = await add_rows(db, ["bot"], content="while you were away")
    await trio.sleep(1.0)
    assert server.requests == []  # nothing wakes the loop for this row ...
    [pid] = await backend_pids(db, pod.pglistener.application_name)
    t0 = trio.current_time()
    assert await terminate_backend(db, pid)
    with trio.fail_after(10):  # ... until the reconnect wakes every subscriber (poll: 60 s)
        await server.got_request.wait()
    print(f"terminate -> row delivered: {(trio.current_time() - t0) * 1000:.0f} ms")
    assert server.requests[0]["headers"]["webhook-id"] == str(row)
    assert pod.pglistener.status()["reconnects"] == 1
