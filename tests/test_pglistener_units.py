"""Listener pieces without a database: subscription coalescing, names, and the reconnect
backoff (under autojump_clock with a fake connect)."""

from __future__ import annotations

import pytest
import trio

from relay_trio import channels
from relay_trio.config import Settings
from relay_trio.db import DatabaseUnavailable
from relay_trio.metrics import Metrics
from relay_trio import pglistener
from relay_trio.pglistener import PgListener, Subscription, Wake, application_name, heartbeat_channel


def W(payload, reconnect=False):
    return Wake("c", payload, reconnect)


async def test_full_buffer_keeps_one_pending_wake_that_covers_every_merged_payload():
    sub = Subscription(None, "c", buffer=2)
    for i in range(5):
        assert sub._push(W(str(i))) is True  # never raises, never blocks
    # "2", "3" and "4" merged: different hints become None ("look at everything"), so a
    # subscriber that filters on names (the delivery loop's routes) never misses its own.
    assert [sub.receive_nowait().payload for _ in range(3)] == ["0", "1", None]
    with pytest.raises(trio.WouldBlock):
        sub.receive_nowait()
    assert sub.coalesced == 3


async def test_identical_payloads_merge_into_that_payload():
    sub = Subscription(None, "c", buffer=1)
    for _ in range(3):
        sub._push(W("bot"))
    assert [sub.receive_nowait().payload for _ in range(2)] == ["bot", "bot"]


async def test_a_pending_reconnect_wake_is_never_downgraded():
    sub = Subscription(None, "c", buffer=1)
    sub._push(W("a"))
    sub._push(W(None, reconnect=True))
    sub._push(W("b"))
    assert sub.receive_nowait() == W("a")
    assert sub.receive_nowait() == W(None, reconnect=True)


async def test_receive_waits_and_close_ends_iteration():
    sub = Subscription(None, "c")
    got = []

    async def consume():
        async for wake in sub:
            got.append(wake)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.sleep(0.01)
        sub._push(W("x"))
        await trio.sleep(0.01)
        sub.close()
    assert got == [W("x")]
    assert sub._push(W("y")) is False
    with pytest.raises(trio.ClosedResourceError):
        await sub.receive()


def test_names_fit_postgres_limits():
    long_id = "pod-" + "é" * 80
    assert len(application_name(long_id).encode()) <= 63
    assert application_name("p1") == "relay-listener:p1"
    hb = heartbeat_channel(long_id)
    assert hb.startswith(channels.HEARTBEAT_PREFIX) and len(hb.encode()) <= 63
    assert heartbeat_channel("Pod A") != heartbeat_channel("pod_a")  # cleaned names still differ
    channels.check_channel_name(hb)


async def test_reconnect_backoff_is_jittered_exponential_and_capped(autojump_clock, monkeypatch):
    attempts: list[float] = []

    async def refuse(*args, **kwargs):
        attempts.append(trio.current_time())
        raise DatabaseUnavailable("refused")

    monkeypatch.setattr(pglistener, "connect_dedicated", refuse)
    listener = PgListener("postgresql://nowhere/x", "p1", Settings(database_url="x"), Metrics())
    async with trio.open_nursery() as nursery:
        # A database that is down never blocks the pod's start.
        await nursery.start(listener.run)
        assert listener.status()["state"] == "reconnecting"
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    assert listener.status()["state"] == "stopped"
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert 0.025 <= gaps[0] <= 0.05          # ~50 ms first
    assert gaps[3] > gaps[0] * 2              # growing
    assert max(gaps) <= pglistener.RECONNECT_MAX
    assert 15 <= len(attempts) <= 60          # no hot loop: about one attempt per 1.5-3 s once capped


async def test_server_refusing_listen_is_degraded_with_one_warning(autojump_clock, monkeypatch, caplog):
    import asyncpg

    async def standby(*args, **kwargs):
        raise asyncpg.exceptions.FeatureNotSupportedError("cannot execute LISTEN during recovery")

    monkeypatch.setattr(pglistener, "connect_dedicated", standby)
    listener = PgListener("postgresql://nowhere/x", "p1", Settings(database_url="x"), Metrics())
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        await trio.sleep(30)  # many retries: the component keeps running, one warning only
        assert listener.status()["state"] == "degraded"
        nursery.cancel_scope.cancel()
    warnings = [r for r in caplog.records if "DEGRADED" in r.getMessage()]
    assert len(warnings) == 1 and "during recovery" in warnings[0].getMessage()
