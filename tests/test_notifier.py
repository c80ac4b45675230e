"""CoalescedNotifier timing and payload rules, under pytest-trio's autojump_clock with a
fake sender (the real pg_notify path is covered in test_intake_notify.py)."""

from __future__ import annotations

import logging

import trio

from relay_trio import channels
from relay_trio.db import DatabaseUnavailable
from relay_trio.metrics import Metrics
from relay_trio.notifier import CoalescedNotifier, truncate_utf8

WINDOW = 0.005


class FakeSender:
    def __init__(self, delay: float = 0.0, fail: bool = False):
        self.sent: list[tuple[float, str, str]] = []
        self.delay = delay
        self.fail = fail

    async def __call__(self, channel: str, payload: str) -> None:
        if self.delay:
            await trio.sleep(self.delay)
        if self.fail:
            raise DatabaseUnavailable("database is down")
        self.sent.append((trio.current_time(), channel, payload))


async def start(nursery, sender, window=WINDOW, metrics=None) -> CoalescedNotifier:
    notifier = CoalescedNotifier(sender, window=window, metrics=metrics)
    await nursery.start(notifier.run)
    return notifier


async def test_leading_edge_sends_the_first_request_at_once(nursery, autojump_clock):
    sender = FakeSender()
    notifier = await start(nursery, sender)
    t0 = trio.current_time()
    notifier.request(channels.OUTBOX, "bot")
    await trio.sleep(0.0001)
    assert [(t - t0, ch, p) for t, ch, p in sender.sent] == [(0.0, channels.OUTBOX, "bot")]


async def test_requests_inside_the_window_merge_into_one_at_its_end(nursery, autojump_clock):
    metrics = Metrics()
    sender = FakeSender()
    notifier = await start(nursery, sender, metrics=metrics)
    t0 = trio.current_time()
    notifier.request(channels.OUTBOX, "a")
    await trio.sleep(0.001)
    for name in ("b", "c", "b", "d"):
        notifier.request(channels.OUTBOX, name)
        await trio.sleep(0.0005)
    await trio.sleep(0.1)
    assert [(round(t - t0, 6), p) for t, _, p in sender.sent] == [(0.0, "a"), (WINDOW, "b,c,d")]
    assert metrics.registry.get_sample_value("relay_notifies_sent_total", {"channel": channels.OUTBOX}) == 2
    assert metrics.registry.get_sample_value("relay_notifies_merged_total", {"channel": channels.OUTBOX}) == 3


async def test_the_last_request_is_never_lost(nursery, autojump_clock):
    # A slow send: requests arriving while a NOTIFY is in flight go out in the next one.
    sender = FakeSender(delay=0.02)
    notifier = await start(nursery, sender)
    notifier.request(channels.OUTBOX, "first")
    await trio.sleep(0.01)  # the first send is in flight
    notifier.request(channels.OUTBOX, "last")
    await trio.sleep(1)
    assert [p for _, _, p in sender.sent] == ["first", "last"]


async def test_a_quiet_window_lets_the_next_request_go_at_once(nursery, autojump_clock):
    sender = FakeSender()
    notifier = await start(nursery, sender)
    notifier.request(channels.OUTBOX, "a")
    await trio.sleep(1)
    t1 = trio.current_time()
    notifier.request(channels.OUTBOX, "b")
    await trio.sleep(0.0001)
    assert [(p, t == t1) for t, _, p in sender.sent] == [("a", False), ("b", True)]


async def test_channels_coalesce_independently(nursery, autojump_clock):
    sender = FakeSender()
    notifier = await start(nursery, sender)
    notifier.request(channels.OUTBOX, "bot")
    notifier.request(channels.EVENTS, "7")
    await trio.sleep(0.0001)
    assert sorted((ch, p) for _, ch, p in sender.sent) == [(channels.EVENTS, "7"), (channels.OUTBOX, "bot")]


async def test_events_channel_payload_is_the_highest_seq(nursery, autojump_clock):
    sender = FakeSender()
    notifier = await start(nursery, sender)
    notifier.request(channels.EVENTS, "1")
    await trio.sleep(0.0001)  # the leading NOTIFY goes out
    for seq in ("5", "3", "9", "2"):
        notifier.request(channels.EVENTS, seq)
    await trio.sleep(1)
    assert [p for _, _, p in sender.sent] == ["1", "9"]


async def test_payload_stays_under_the_notify_limit(nursery, autojump_clock):
    sender = FakeSender()
    notifier = await start(nursery, sender)
    notifier.request(channels.OUTBOX, "x")
    await trio.sleep(0.0001)  # the leading NOTIFY goes out
    names = [f"listener-{i:04d}-" + "é" * 50 for i in range(400)]  # ~45 KB of hints
    for name in names:
        notifier.request(channels.OUTBOX, name)
    notifier.request(channels.OUTBOX, "ü" * 9000)  # one hint alone over the limit
    await trio.sleep(1)
    payloads = [p for _, _, p in sender.sent]
    assert len(payloads) == 2
    assert all(len(p.encode("utf-8")) <= channels.MAX_PAYLOAD_BYTES for p in payloads)
    # More names than fit: the merged NOTIFY says "everyone" (empty payload) rather than
    # silently dropping names that some pod may route exclusively.
    assert payloads[1] == ""


def test_truncate_utf8_never_splits_a_character():
    text = "a" + "é" * 10
    cut = truncate_utf8(text, 4)
    assert cut == "aé" and len(cut.encode()) <= 4


async def test_database_down_is_logged_and_dropped_never_fatal(nursery, autojump_clock, caplog):
    sender = FakeSender(fail=True)
    notifier = await start(nursery, sender)
    with caplog.at_level(logging.DEBUG, logger="relay_trio.notifier"):
        for i in range(5):
            notifier.request(channels.OUTBOX, f"n{i}")
            await trio.sleep(0.1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # the first failure is loud, the rest quiet
    sender.fail = False
    notifier.request(channels.OUTBOX, "back")
    await trio.sleep(0.1)
    assert [p for _, _, p in sender.sent] == ["back"]


async def test_request_is_sync_and_never_blocks(nursery, autojump_clock):
    sender = FakeSender(delay=10)
    notifier = await start(nursery, sender)
    t0 = trio.current_time()
    for i in range(10_000):
        assert notifier.request(channels.OUTBOX, f"n{i % 7}") is None
    assert trio.current_time() == t0


async def test_a_hint_that_does_not_fit_turns_the_payload_into_wake_everyone(nursery, autojump_clock):
    sender = FakeSender()
    notifier = await start(nursery, sender)
    notifier.request(channels.OUTBOX, "first")
    await trio.sleep(0.0001)
    big = "x" * 5000
    notifier.request(channels.OUTBOX, big + "1")
    notifier.request(channels.OUTBOX, big + "2")  # cannot fit beside the first: dropped
    notifier.request(channels.OUTBOX, None)
    await trio.sleep(0.1)
    payloads = [p for _, _, p in sender.sent]
    assert payloads == ["first", ""], "a dropped name must become an empty (everyone) payload"
    # and the next window starts clean
    notifier.request(channels.OUTBOX, "after")
    await trio.sleep(0.1)
    assert [p for _, _, p in sender.sent][-1] == "after"


def test_join_hints_never_silently_drops_a_name():
    from relay_trio.intake import join_hints

    assert join_hints(["a", "b"]) == "a,b"
    assert join_hints(["x" * 5000, "y" * 5000]) == ""
