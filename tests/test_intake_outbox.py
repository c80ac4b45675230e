"""The transactional outbox and the post-commit hand-off (real PostgreSQL, no HTTP).

A Pod with no components is used so nothing else consumes the hand-off channel.
"""

from __future__ import annotations

import asyncpg
import pytest
import trio

from intake_helpers import RecordingNotifier, add_listener, bare_pod, drain, event, execute, fetch, fetchval
from relay_trio import channels
from relay_trio.intake import accept_event


async def test_committed_mention_hands_off_exactly_its_outbox_id(db, database_url):
    pod = bare_pod(db, database_url)
    pod.notifier = RecordingNotifier()
    await add_listener(db, "bot")
    result = await accept_event(pod, event(mentions=["bot", "ghost"]))
    assert result.status == 202
    rows = await fetch(db, "SELECT id, listener, status, event_seq FROM deliveries")
    assert [(r["listener"], r["status"], r["event_seq"]) for r in rows] == [("bot", "pending", result.body["seq"])]
    assert drain(pod.handoff_recv) == [rows[0]["id"]]
    assert result.body["deliveries"] == [{"listener": "bot", "delivery_id": rows[0]["id"]}]
    assert result.body["unrouted"] == ["ghost"]
    # Routed here and handed off: no outbox NOTIFY, only the events-channel wake.
    assert pod.notifier.requests == [(channels.EVENTS, str(result.body["seq"]))]
    assert pod.metrics.handoffs_sent._value.get() == 1


async def test_event_without_registered_mention_hands_off_nothing(db, database_url):
    pod = bare_pod(db, database_url)
    await add_listener(db, "bot")
    await add_listener(db, "sleepy", enabled=False)
    result = await accept_event(pod, event(mentions=["nobody", "sleepy"]))
    assert result.status == 202
    assert result.body["deliveries"] == []
    assert result.body["unrouted"] == ["nobody", "sleepy"]  # disabled listeners are unrouted too
    assert drain(pod.handoff_recv) == []
    assert await fetchval(db, "SELECT count(*) FROM deliveries") == 0
    assert await fetchval(db, "SELECT count(*) FROM events") == 1


async def test_rolled_back_mention_hands_off_nothing_and_leaves_no_rows(db, database_url):
    pod = bare_pod(db, database_url)
    pod.notifier = RecordingNotifier()
    await add_listener(db, "bot")
    # Fail the transaction AFTER the event and its outbox row were written (at the
    # response UPDATE), so only a hand-off before COMMIT could leak an id.
    await execute(
        db,
        """
        CREATE FUNCTION test_explode() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN IF NEW.channel = 'explode' THEN RAISE EXCEPTION 'explode'; END IF; RETURN NEW; END $$;
        CREATE TRIGGER test_explode BEFORE UPDATE ON events FOR EACH ROW EXECUTE FUNCTION test_explode();
        """,
    )
    with pytest.raises(asyncpg.RaiseError):
        await accept_event(pod, event(channel="explode", mentions=["bot"]))
    assert drain(pod.handoff_recv) == []
    assert pod.notifier.requests == []
    assert await fetchval(db, "SELECT count(*) FROM events") == 0
    assert await fetchval(db, "SELECT count(*) FROM deliveries") == 0
    # And the same pod keeps working afterwards.
    ok = await accept_event(pod, event(mentions=["bot"]))
    assert drain(pod.handoff_recv) == [ok.body["deliveries"][0]["delivery_id"]]


async def test_full_handoff_channel_drops_without_blocking_and_row_stays_claimable(db, database_url):
    pod = bare_pod(db, database_url, handoff_capacity=2)
    pod.notifier = RecordingNotifier()
    await add_listener(db, "bot")
    await add_listener(db, "helper")
    ids = []
    with trio.fail_after(10):  # intake must never wait for the worker
        for i in range(3):
            result = await accept_event(pod, event(content=f"m{i}", mentions=["bot", "helper"]))
            ids += [d["delivery_id"] for d in result.body["deliveries"]]
    assert len(ids) == 6
    handed = drain(pod.handoff_recv)
    assert handed == ids[:2]
    assert pod.metrics.handoffs_dropped._value.get() == 4
    assert pod.metrics.handoffs_sent._value.get() == 2
    # Dropped ids ask the notifier to wake a LISTENing pod (this one included).
    outbox_hints = [hint for ch, hint in pod.notifier.requests if ch == channels.OUTBOX]
    assert set(outbox_hints) == {"bot", "helper"}
    claimable = await fetch(
        db,
        """SELECT id FROM deliveries WHERE status = 'pending' AND due_at <= clock_timestamp()
           AND lease_owner IS NULL ORDER BY id""",
    )
    assert [r["id"] for r in claimable] == sorted(ids)


async def test_rows_this_pod_does_not_route_ask_for_a_notify_instead(db, database_url):
    pod = bare_pod(db, database_url, routes="helper")
    pod.notifier = RecordingNotifier()
    await add_listener(db, "bot")
    await add_listener(db, "helper")
    result = await accept_event(pod, event(mentions=["bot", "helper"]))
    by_name = {d["listener"]: d["delivery_id"] for d in result.body["deliveries"]}
    assert drain(pod.handoff_recv) == [by_name["helper"]]
    assert (channels.OUTBOX, "bot") in pod.notifier.requests
    assert (channels.OUTBOX, "helper") not in pod.notifier.requests


async def test_notify_mode_off_sends_nothing(db, database_url):
    pod = bare_pod(db, database_url, routes="helper", notify_mode="off")
    pod.notifier = RecordingNotifier()
    await add_listener(db, "bot")
    await accept_event(pod, event(mentions=["bot"]))
    assert pod.notifier.requests == []


async def test_mentions_collapse_and_order_follows_the_mentions(db, database_url):
    pod = bare_pod(db, database_url)
    for name in ("zed", "amy"):
        await add_listener(db, name)
    result = await accept_event(pod, event(mentions=["zed", "amy", "zed"]))
    assert [d["listener"] for d in result.body["deliveries"]] == ["zed", "amy"]
    assert await fetchval(db, "SELECT count(*) FROM deliveries") == 2
    assert await fetchval(db, "SELECT mentions FROM events") == ["zed", "amy"]


async def test_notify_tx_refuses_what_postgres_would_refuse_before_sending(db):
    from relay_trio.store.events import NotifyPayloadError, notify_tx

    async def send(conn, channel, payload):
        await notify_tx(conn, channel, payload)
        return await conn.fetchval("SELECT 1")  # the transaction is still usable

    assert await db.run_tx(send, channels.OUTBOX, "é" * 3999 + "x") == 1  # 7999 bytes
    for channel, payload in ((channels.OUTBOX, "é" * 4000), ("c" * 64, "x")):  # 8000 bytes; 64-byte channel
        with pytest.raises(NotifyPayloadError):
            await db.run_tx(send, channel, payload)
