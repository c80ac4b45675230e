"""Waking other pods: the coalesced outbox NOTIFY after commit (real PostgreSQL, real LISTEN)."""

from __future__ import annotations

import trio

from intake_helpers import add_listener, bare_pod, event, listening, wait_until
from relay_trio import channels
from relay_trio.intake import accept_event
from relay_trio.notifier import notifier_component


def sent(pod, channel: str) -> float:
    return pod.metrics.registry.get_sample_value("relay_notifies_sent_total", {"channel": channel}) or 0.0


def merged(pod, channel: str) -> float:
    return pod.metrics.registry.get_sample_value("relay_notifies_merged_total", {"channel": channel}) or 0.0


async def test_unrouted_mention_wakes_a_listen_connection(db, database_url, nursery):
    pod = bare_pod(db, database_url, routes="someone-else")
    await nursery.start(notifier_component, pod)
    await add_listener(db, "bot")
    async with listening(database_url, channels.OUTBOX, channels.EVENTS) as got:
        result = await accept_event(pod, event(mentions=["bot"]))
        await wait_until(lambda: (channels.OUTBOX, "bot") in got)
        await wait_until(lambda: (channels.EVENTS, str(result.body["seq"])) in got)
    assert pod.handoff_recv.statistics().current_buffer_used == 0  # not routed here: no hand-off


async def test_fifty_commits_in_one_window_send_far_fewer_notifies_and_lose_no_hint(db, database_url, nursery):
    # A generous window (real time, shared CI cores): all 50 commits land in very few windows.
    pod = bare_pod(db, database_url, routes="someone-else", notify_window=2.0)
    await nursery.start(notifier_component, pod)
    names = [f"bot{i}" for i in range(50)]
    for name in names:
        await add_listener(db, name)
    seqs = []
    async with listening(database_url, channels.OUTBOX, channels.EVENTS) as got:

        async def one(name):
            result = await accept_event(pod, event(content=name, mentions=[name]))
            seqs.append(result.body["seq"])

        async with trio.open_nursery() as n:
            for name in names:
                n.start_soon(one, name)

        def outbox_hints():
            return {h for ch, p in got if ch == channels.OUTBOX for h in p.split(",") if h}

        # The last request is never lost: every hint arrives (the trailing NOTIFY carries it).
        await wait_until(lambda: outbox_hints() == set(names), timeout=20)
        await wait_until(lambda: (channels.EVENTS, str(max(seqs))) in got, timeout=20)
        outbox = [p for ch, p in got if ch == channels.OUTBOX]
        events = [p for ch, p in got if ch == channels.EVENTS]
    assert len(outbox) <= 10, outbox
    # A NOTIFY can reach the listener before the notifier counts it (the count follows the
    # send's return): wait for the counters to catch up rather than race them.
    await wait_until(lambda: sent(pod, channels.OUTBOX) == len(outbox), timeout=10)
    await wait_until(lambda: merged(pod, channels.OUTBOX) == 50 - len(outbox), timeout=10)
    assert len(events) <= 10
    assert all(len(p.encode()) <= channels.MAX_PAYLOAD_BYTES for p in outbox)


async def test_in_tx_mode_sends_one_notify_per_commit(db, database_url, nursery):
    """The comparison baseline: NOTIFY inside each event transaction, nothing coalesced."""
    pod = bare_pod(db, database_url, routes="someone-else", notify_mode="in-tx", notify_window=2.0)
    await nursery.start(notifier_component, pod)
    await add_listener(db, "bot")
    async with listening(database_url, channels.OUTBOX) as got:
        for i in range(5):
            await accept_event(pod, event(content=f"m{i}", mentions=["bot"]))
        await wait_until(lambda: len(got) == 5)
    assert sent(pod, channels.OUTBOX) == 0  # the notifier was not involved
