"""The hand-rolled, reconnecting LISTEN/NOTIFY listener (one dedicated connection per pod).

Why hand-rolled: a LISTEN on a pooled connection is discarded at release (the reset runs
``UNLISTEN *``), and the failure modes that matter (a killed backend, a frozen backend, a
half-open socket, a transaction-pooling proxy that swallows notifications) all fail
*silently* unless the listener checks itself. So this module:

* owns one asyncpg connection outside the pool, ``application_name=relay-listener:<pod>``
  so operators and tests find its backend in ``pg_stat_activity``;
* LISTENs every subscribed channel on it, and after every (re)connect wakes every
  subscriber exactly once with ``Wake(reconnect=True, payload=None)`` -- notifications sent
  while it was down are gone, so subscribers must re-read state ("LISTEN, then read");
* proves the whole path with a NOTIFY round trip to itself (a pod-specific heartbeat
  channel) at start and every ``heartbeat_interval``, under a trio deadline; a miss
  terminates the connection and reconnects (catches a SIGSTOPped backend), and a failed
  start-up probe reports the listener as *degraded* (one warning, metrics, /readyz detail)
  while it keeps retrying in the background;
* enables client TCP keepalive on the socket (catches silently dropped packets);
* reconnects with jittered exponential backoff (50 ms .. 3 s).

Threading note: asyncpg calls the notification callback (``PgListener._on_notify``) on the
asyncio side of the same thread (trio-asyncio). It only pushes into in-memory subscriber
buffers, which never block and never raise (a full buffer coalesces into one pending wake),
and the whole body is wrapped so nothing can escape into the loop's exception handler.
Every other asyncpg call crosses through ``relay_trio.db`` (``connect_dedicated``,
``on_connection``) with ops from ``relay_trio.store.listen``.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import socket
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import asyncpg
import trio

from relay_trio import channels as ch
from relay_trio.config import Settings
from relay_trio.db import DatabaseUnavailable, connect_dedicated, enable_tcp_keepalive, is_connection_lost, on_connection
from relay_trio.metrics import Metrics
from relay_trio.store import listen as listen_ops

log = logging.getLogger("relay_trio.pglistener")

RECONNECT_MIN = 0.05  # first retry delay, seconds (before jitter)
RECONNECT_MAX = 3.0   # backoff ceiling, seconds
STABLE_AFTER = 5.0    # a connection healthy this long resets the backoff
CONNECT_TIMEOUT = 5.0
DEFAULT_BUFFER = 16
STATES = ("connected", "reconnecting", "degraded", "stopped")


@dataclass(frozen=True)
class Wake:
    channel: str
    payload: str | None  # None after a (re)connect: "re-read everything"
    reconnect: bool


def _merge(pending: Wake | None, new: Wake) -> Wake:
    """Coalesce two wakes into one. A reconnect is never downgraded, and two different
    payloads merge into None ("look at everything"): subscribers may filter on payload
    hints, so keeping only the newest could drop the one name a subscriber cares about."""
    if pending is None:
        return new
    if pending.reconnect:
        return pending
    if new.reconnect or pending.payload == new.payload:
        return new
    return Wake(new.channel, None, False)


class Subscription:
    """One subscriber on one channel: a small buffer of wakes that coalesces when full.

    ``_push`` is called from the asyncpg callback (asyncio side, same thread) and from trio
    code; it never blocks and never raises. When the buffer is full, the newest wake is
    kept as ONE pending wake (payloads are hints; a subscriber re-reads state anyway), so
    the final wake of a burst is never lost.

    The first wake a subscription receives is always ``reconnect=True``: it means "the
    channel is now LISTENed; read the current state".
    """

    def __init__(self, listener: PgListener | None, channel: str, buffer: int = DEFAULT_BUFFER):
        self.channel = channel
        self._listener = listener
        self._buffer: deque[Wake] = deque()
        self._capacity = max(1, buffer)
        self._pending: Wake | None = None
        self._closed = False
        self._lot = trio.lowlevel.ParkingLot()
        self.coalesced = 0  # wakes merged into the pending one (for tests / debugging)

    def _push(self, wake: Wake) -> bool:
        if self._closed:
            return False
        if self._pending is not None and len(self._buffer) < self._capacity:
            self._buffer.append(self._pending)
            self._pending = None
        if len(self._buffer) < self._capacity:
            self._buffer.append(wake)
        else:
            self._pending = _merge(self._pending, wake)
            self.coalesced += 1
        self._lot.unpark_all()
        return True

    def _take(self) -> Wake | None:
        if self._buffer:
            wake = self._buffer.popleft()
            if self._pending is not None:
                self._buffer.append(self._pending)
                self._pending = None
            return wake
        if self._pending is not None:
            wake, self._pending = self._pending, None
            return wake
        return None

    def receive_nowait(self) -> Wake:
        """The next wake, or ``trio.WouldBlock`` when none is waiting."""
        if self._closed:
            raise trio.ClosedResourceError("subscription closed")
        wake = self._take()
        if wake is None:
            raise trio.WouldBlock
        return wake

    async def receive(self) -> Wake:
        """Wait for the next wake."""
        while True:
            if self._closed:
                raise trio.ClosedResourceError("subscription closed")
            wake = self._take()
            if wake is not None:
                await trio.lowlevel.checkpoint()
                return wake
            await self._lot.park()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Wake:
        try:
            return await self.receive()
        except trio.ClosedResourceError:
            raise StopAsyncIteration from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lot.unpark_all()
        if self._listener is not None:
            self._listener._unsubscribe(self)


def heartbeat_channel(pod_id: str) -> str:
    """A pod-specific heartbeat channel: safe characters plus a hash (ids may collide once cleaned)."""
    digest = hashlib.sha1(pod_id.encode("utf-8")).hexdigest()[:8]
    safe = re.sub(r"[^a-z0-9_]", "_", pod_id.lower())
    room = ch.MAX_CHANNEL_BYTES - len(ch.HEARTBEAT_PREFIX) - len(digest) - 1
    return f"{ch.HEARTBEAT_PREFIX}{safe[:room]}_{digest}"


def application_name(pod_id: str) -> str:
    """``relay-listener:<pod id>``, truncated to PostgreSQL's 63 bytes (on a character boundary)."""
    raw = f"relay-listener:{pod_id}".encode("utf-8")[:63]
    return raw.decode("utf-8", errors="ignore")


class _ConnectionLost(Exception):
    """Internal: the current connection must be replaced."""


class PgListener:
    """LISTEN/NOTIFY on one dedicated connection, with subscribers, reconnect and heartbeat."""

    def __init__(self, dsn: str, pod_id: str, settings: Settings, metrics: Metrics):
        self.dsn = dsn
        self.pod_id = pod_id
        self.settings = settings
        self.metrics = metrics
        self.application_name = application_name(pod_id)
        self.heartbeat_channel = heartbeat_channel(pod_id)
        self._subs: dict[str, set[Subscription]] = {}
        self._channels: set[str] = set()     # every channel ever subscribed (LISTENed on each connection)
        self._listening: set[str] = set()    # channels LISTENed on the current connection
        self._channels_changed = trio.Event()
        self._conn: Any = None
        # asyncpg runs one operation at a time per connection; the heartbeat, late LISTENs and
        # notify() share it, and "another operation is in progress" must not look like a loss.
        self._conn_lock = trio.Lock()
        self._hb_token: str | None = None
        self._hb_arrived = trio.Event()
        self._state = "stopped"
        self._since = datetime.now(timezone.utc)
        self._reconnects = 0
        self._rtt: float | None = None
        self._wakes: dict[str, int] = {}
        self._warned_degraded = False
        self._lost_reason = "terminated by the server"
        self.backend_pid: int | None = None
        self._set_state("stopped")

    # -- subscribers ------------------------------------------------------------------
    def subscribe(self, channel: str, *, buffer: int = DEFAULT_BUFFER) -> Subscription:
        """Register a subscriber; a new channel is LISTENed on the live connection (or the next one)."""
        ch.check_channel_name(channel)
        if channel == self.heartbeat_channel:
            raise ValueError("the heartbeat channel is reserved")
        sub = Subscription(self, channel, buffer)
        self._subs.setdefault(channel, set()).add(sub)
        if channel in self._listening and self._state == "connected":
            # Already LISTENed on a live connection: this subscriber is ready now.
            self._deliver(sub, Wake(channel, None, True))
        elif channel not in self._channels:
            self._channels.add(channel)
            self._channels_changed.set()
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.channel)
        if subs is not None:
            subs.discard(sub)  # the channel stays LISTENed: cheap, and a later subscriber reuses it

    def _deliver(self, sub: Subscription, wake: Wake) -> None:
        if sub._push(wake):
            self._wakes[wake.channel] = self._wakes.get(wake.channel, 0) + 1
            self.metrics.listener_wakes.labels(channel=wake.channel).inc()

    def _wake_all(self, channels: set[str]) -> None:
        """After a (re)connect: wake every subscriber of these channels exactly once."""
        for channel in sorted(channels):
            for sub in list(self._subs.get(channel, ())):
                self._deliver(sub, Wake(channel, None, True))

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        """asyncpg's notification callback (asyncio side): never raises, never blocks."""
        try:
            if channel == self.heartbeat_channel:
                if payload == self._hb_token:
                    self._hb_arrived.set()
                return
            for sub in list(self._subs.get(channel, ())):
                self._deliver(sub, Wake(channel, payload, False))
        except Exception:  # pragma: no cover - defensive: must never reach the loop
            log.exception("listener callback failed", extra={"channel": channel})

    # -- status -------------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        if state != self._state or state == "stopped":
            self._since = datetime.now(timezone.utc)
        self._state = state
        for s in STATES:
            self.metrics.listener_state.labels(state=s).set(1 if s == state else 0)

    @property
    def state(self) -> str:
        return self._state

    def status(self) -> dict:
        return {
            "state": self._state,
            "reconnects": self._reconnects,
            "heartbeat_rtt_ms": None if self._rtt is None else round(self._rtt * 1000, 3),
            "wakes": dict(self._wakes),
            "since": self._since.isoformat(),
        }

    # -- operations on the dedicated connection ---------------------------------------
    async def notify(self, channel: str, payload: str | None = None) -> None:
        """NOTIFY on the listener's own connection (tests, diagnostics)."""
        ch.check_notify_payload(channel, payload)
        conn = self._conn
        if conn is None:
            raise DatabaseUnavailable("the listener is not connected")
        async with self._conn_lock:
            await on_connection(conn, listen_ops.notify, channel, payload, timeout=self.settings.db_timeout)

    async def listening_channels(self) -> list[str]:
        """pg_listening_channels() of the listener's backend (tests, diagnostics)."""
        conn = self._conn
        if conn is None:
            raise DatabaseUnavailable("the listener is not connected")
        async with self._conn_lock:
            return await on_connection(conn, listen_ops.listening_channels, timeout=self.settings.db_timeout)

    async def _round_trip(self, conn: Any) -> float | None:
        """NOTIFY ourselves on the heartbeat channel and wait for it; the RTT, or None on a miss.

        A connection that is lost outright raises ``DatabaseUnavailable`` (a reconnect, not a
        degraded listener).
        """
        token = uuid.uuid4().hex
        self._hb_token = token
        self._hb_arrived = trio.Event()
        timeout = self.settings.heartbeat_timeout
        start = trio.current_time()
        with trio.move_on_after(timeout):
            async with self._conn_lock:
                await on_connection(conn, listen_ops.notify, self.heartbeat_channel, token, timeout=timeout + 1)
            await self._hb_arrived.wait()
            rtt = trio.current_time() - start
            self._rtt = rtt
            self.metrics.listener_heartbeat_rtt.set(rtt)
            return rtt
        return None

    # -- supervision ----------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Connect, LISTEN all, probe, wake all, started(); then keep it alive forever.

        ``started()`` is also called after a first attempt that fails, so a database that
        is down (or a proxy that swallows notifications) never blocks the pod's start:
        delivery continues on hand-off and poll while this keeps retrying.
        """
        started = False
        attempt = 0
        ever_connected = False
        self._set_state("reconnecting")
        try:
            while True:
                healthy_since: float | None = None

                def on_ready() -> None:
                    # Connected, LISTENing, probed and every subscriber woken.
                    nonlocal healthy_since, ever_connected, started
                    healthy_since = trio.current_time()
                    if ever_connected:
                        self._reconnects += 1
                        self.metrics.listener_reconnects.inc()
                        log.info("listener reconnected", extra={"pod": self.pod_id, "reconnects": self._reconnects})
                    ever_connected = True
                    if not started:
                        started = True
                        task_status.started()

                try:
                    await self._session(on_ready)
                except _ConnectionLost as exc:
                    log.warning("listener connection lost: %s; reconnecting", exc, extra={"pod": self.pod_id})
                except DatabaseUnavailable as exc:
                    log.warning("listener cannot connect: %s; retrying", exc, extra={"pod": self.pod_id})
                except asyncpg.PostgresError as exc:
                    # The server refused LISTEN or NOTIFY itself (a hot standby: "cannot execute
                    # LISTEN during recovery"): the same silent-loss risk as a failed probe.
                    self._enter_degraded(f"the server refused LISTEN/NOTIFY: {type(exc).__name__}: {exc}")
                except Exception as exc:
                    if not is_connection_lost(exc):
                        raise
                    log.warning("listener connection failed: %r; reconnecting", exc, extra={"pod": self.pod_id})
                if self._state != "degraded":
                    self._set_state("reconnecting")
                if not started:
                    started = True
                    task_status.started()
                if healthy_since is not None and trio.current_time() - healthy_since >= STABLE_AFTER:
                    attempt = 0  # it was stable: the next loss starts again from ~50 ms
                attempt += 1  # a server that accepts and then drops us at once still backs off
                delay = min(RECONNECT_MAX, RECONNECT_MIN * 2 ** min(attempt - 1, 16))
                await trio.sleep(delay * random.uniform(0.5, 1.0))
        finally:
            self._set_state("stopped")

    async def _session(self, on_ready) -> None:
        """One connection's life: calls ``on_ready()`` once healthy; returns (degraded) or raises when it ends."""
        conn = await connect_dedicated(self.dsn, self.application_name, timeout=CONNECT_TIMEOUT)
        lost = trio.Event()
        self._listening = set()
        try:
            conn.add_termination_listener(lambda _c: lost.set())
            enable_tcp_keepalive(conn)
            self.backend_pid = conn.get_server_pid()
            snapshot = set(self._channels)
            await on_connection(
                conn, listen_ops.listen_channels, [self.heartbeat_channel, *sorted(snapshot)], self._on_notify,
                timeout=self.settings.db_timeout,
            )
            self._conn = conn
            rtt = await self._round_trip(conn)
            if rtt is None:
                self._enter_degraded(
                    f"a NOTIFY to ourselves did not arrive within {self.settings.heartbeat_timeout:.1f}s "
                    "(a transaction-pooling proxy in front of the database?)"
                )
                return
            if self._warned_degraded:
                log.warning("listener self-probe succeeded again; LISTEN/NOTIFY wakes restored", extra={"pod": self.pod_id})
                self._warned_degraded = False
            self._set_state("connected")
            # Only now, LISTEN in effect: wake everyone once so each re-reads what it missed.
            self._listening = snapshot
            self._wake_all(snapshot)
            on_ready()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._heartbeat_loop, conn, lost)
                nursery.start_soon(self._listen_new_channels, conn, lost)
                await lost.wait()
                nursery.cancel_scope.cancel()
            raise _ConnectionLost(self._lost_reason)
        finally:
            self._conn = None
            self._listening = set()
            await self._close(conn, graceful=not lost.is_set())

    def _enter_degraded(self, reason: str) -> None:
        """Report (once per episode) that wakes are unavailable; never fail silently."""
        self._set_state("degraded")
        if not self._warned_degraded:
            self._warned_degraded = True
            log.warning(
                "LISTEN/NOTIFY self-probe failed: %s. The listener is DEGRADED: delivery continues "
                "on hand-off and poll; retrying in the background.",
                reason,
                extra={"pod": self.pod_id},
            )
        else:
            log.debug("listener still degraded: %s", reason, extra={"pod": self.pod_id})

    async def _heartbeat_loop(self, conn: Any, lost: trio.Event) -> None:
        while True:
            await trio.sleep(self.settings.heartbeat_interval)
            try:
                rtt = await self._round_trip(conn)
            except DatabaseUnavailable as exc:
                self._lost_reason = f"heartbeat failed: {exc}"
                lost.set()
                return
            if rtt is None:
                self._lost_reason = f"heartbeat missed (no NOTIFY round trip within {self.settings.heartbeat_timeout:.1f}s)"
                lost.set()
                return

    async def _listen_new_channels(self, conn: Any, lost: trio.Event) -> None:
        """LISTEN channels subscribed while connected, then wake their subscribers once."""
        while True:
            await self._channels_changed.wait()
            self._channels_changed = trio.Event()
            new = self._channels - self._listening
            if not new:
                continue
            try:
                async with self._conn_lock:
                    await on_connection(
                        conn, listen_ops.listen_channels, sorted(new), self._on_notify, timeout=self.settings.db_timeout
                    )
            except DatabaseUnavailable as exc:
                self._lost_reason = f"LISTEN failed: {exc}"
                lost.set()
                return
            self._listening |= new
            self._wake_all(new)

    async def _close(self, conn: Any, *, graceful: bool) -> None:
        with trio.CancelScope(shield=True):
            if graceful and not conn.is_closed():
                with trio.move_on_after(1.0):
                    try:
                        await on_connection(conn, listen_ops.close, timeout=1.0)
                    except DatabaseUnavailable:
                        pass
            if not conn.is_closed():
                conn.terminate()
        self._lost_reason = "terminated by the server"


async def pglistener_component(pod, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The pod's listener: created once (kept across supervised restarts: subscribers hold it)."""
    if not pod.settings.listen_enabled:
        task_status.started()
        await trio.sleep_forever()
    listener = pod.pglistener
    if listener is None:
        listener = PgListener(pod.db.dsn, pod.pod_id, pod.settings, pod.metrics)
        pod.pglistener = listener
    await listener.run(task_status=task_status)
