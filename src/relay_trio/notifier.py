"""CoalescedNotifier: wake other pods with NOTIFY after commit, coalesced per channel.

Why: PostgreSQL serializes the commit of every transaction that ran NOTIFY behind one
cluster-wide lock held through the WAL flush. Intake therefore never NOTIFYs inside the
event transaction; after COMMIT it calls ``request(channel, hint)`` (sync, never blocks)
and this component sends the NOTIFY from its own short transaction.

Coalescing, per channel, with a leading edge:
* the first request when no window is open is sent at once and opens a window of
  ``settings.notify_window`` seconds;
* requests arriving while the window is open merge into ONE NOTIFY sent when it closes
  (which opens the next window);
* a request that arrives while a NOTIFY is being sent is kept for the next one: the last
  request is never lost.

Payload = the merged hints, deduplicated, comma-separated and kept under PostgreSQL's
8000-byte limit (hints beyond it are dropped: subscribers re-read state on every wake).
On the events channel the payload is the highest hint (the highest committed seq).
If the database is down the NOTIFY is logged and dropped; the pods' polls cover it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import asyncpg
import trio

from relay_trio import channels
from relay_trio.db import DatabaseUnavailable
from relay_trio.metrics import Metrics
from relay_trio.queries import Q

log = logging.getLogger("relay_trio.notifier")

Sender = Callable[[str, str], Awaitable[None]]


def truncate_utf8(text: str, max_bytes: int) -> str:
    """Cut ``text`` to at most ``max_bytes`` of UTF-8 without splitting a character."""
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode("utf-8", errors="ignore")


class _Pending:
    """Hints waiting for one channel's next NOTIFY. Bounded by the payload limit."""

    def __init__(self, channel: str):
        self.channel = channel
        self.hints: dict[str, None] = {}  # insertion-ordered set
        self.size = 0  # bytes of ",".join(hints)
        self.requests = 0
        self.highest: int | None = None  # events channel: keep only the highest seq
        self.everyone = False  # outbox channel: a hint was missing or dropped -> empty payload
        self.wanted = trio.Event()
        self.window_end = float("-inf")

    def add(self, hint: str | None) -> None:
        self.requests += 1
        if not hint and self.channel != channels.EVENTS:
            self.everyone = True  # no hint: every subscriber must look
        if hint:
            if self.channel == channels.EVENTS:
                try:
                    value = int(hint)
                except ValueError:
                    value = None
                if value is not None:
                    self.highest = value if self.highest is None else max(self.highest, value)
            elif hint not in self.hints:
                hint = truncate_utf8(hint, channels.MAX_PAYLOAD_BYTES)
                extra = len(hint.encode("utf-8")) + (1 if self.hints else 0)
                if self.size + extra <= channels.MAX_PAYLOAD_BYTES:
                    self.hints[hint] = None
                    self.size += extra
                else:
                    # A name that does not fit must not be lost: a pod routing only that
                    # listener filters wakes on the names, so send "everyone" instead.
                    self.everyone = True
        self.wanted.set()

    def take(self) -> tuple[str, int]:
        """Return (payload, number of requests merged into it) and reset."""
        if self.channel == channels.EVENTS:
            payload = "" if self.highest is None else str(self.highest)
        else:
            payload = "" if self.everyone else ",".join(self.hints)
        count = self.requests
        self.everyone = False
        self.hints = {}
        self.size = 0
        self.requests = 0
        self.highest = None
        self.wanted = trio.Event()
        return payload, count


class CoalescedNotifier:
    def __init__(self, send: Sender, *, window: float, metrics: Metrics | None = None):
        self._send = send
        self.window = window
        self.metrics = metrics
        self._pending: dict[str, _Pending] = {}
        self._nursery: trio.Nursery | None = None
        self._failing = False

    def request(self, channel: str, hint: str | None = None) -> None:
        """Ask for a NOTIFY on ``channel``. Sync, never blocks, never raises for a bad hint."""
        pending = self._pending.get(channel)
        if pending is None:
            if self._nursery is None:
                return  # not running (shutting down): the poll covers it
            pending = self._pending[channel] = _Pending(channel)
            self._nursery.start_soon(self._channel_loop, pending)
        pending.add(hint)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self._pending.clear()

    async def _channel_loop(self, pending: _Pending) -> None:
        while True:
            await pending.wanted.wait()
            if trio.current_time() < pending.window_end:
                await trio.sleep_until(pending.window_end)  # trailing edge of the open window
            payload, count = pending.take()
            pending.window_end = trio.current_time() + self.window
            await self._send_logged(pending.channel, payload)
            if self.metrics is not None and count > 1:
                self.metrics.notifies_merged.labels(pending.channel).inc(count - 1)

    async def _send_logged(self, channel: str, payload: str) -> None:
        try:
            await self._send(channel, payload)
        except (DatabaseUnavailable, asyncpg.PostgresError) as exc:
            # The poll finds the rows; log the first failure loudly, the rest quietly.
            (log.debug if self._failing else log.warning)(
                "NOTIFY on %s dropped: %s", channel, exc, extra={"channel": channel}
            )
            self._failing = True
            return
        except Exception:
            log.exception("NOTIFY on %s failed unexpectedly; dropped", channel, extra={"channel": channel})
            return
        if self._failing:
            log.info("NOTIFY on %s works again", channel, extra={"channel": channel})
            self._failing = False
        if self.metrics is not None:
            self.metrics.notifies_sent.labels(channel).inc()


async def _pg_notify(conn: asyncpg.Connection, channel: str, payload: str) -> None:
    await conn.execute(Q["pg_notify"], channel, payload)


async def notifier_component(pod, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Root-nursery component: sets ``pod.notifier`` and sends coalesced NOTIFYs."""

    async def send(channel: str, payload: str) -> None:
        await pod.db.run(_pg_notify, channel, payload, timeout=min(pod.settings.db_timeout, 2.0))

    notifier = CoalescedNotifier(send, window=pod.settings.notify_window, metrics=pod.metrics)
    pod.notifier = notifier
    try:
        await notifier.run(task_status=task_status)
    finally:
        if pod.notifier is notifier:
            pod.notifier = None
