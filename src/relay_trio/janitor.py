"""The janitor: retention sweeps, run by every pod but only by one at a time.

Each pod runs ``janitor_component``; a sweep only happens while this pod holds the
``janitor`` leased lock (store.locks), so two pods never sweep together and a pod that
dies mid-sweep only blocks the others until its lease expires. The lease is renewed
after every batch; when a renewal fails (the lease expired and another pod took it) the
sweep stops at once. The lock is released at the end of each sweep, so whichever pod
wakes first next time does the next one.

A sweep:
  1. dead-letters pending rows older than ``RELAY_DELIVERY_RETENTION`` whose lease is not
     live (dead_reason 'retention'): rows nobody will deliver any more (a disabled or
     paused listener, a route no pod serves);
  2. prunes delivered rows older than ``RELAY_DELIVERED_RETENTION`` and their attempts.
Both in batches of ``batch`` rows per statement. Metrics: ``relay_janitor_sweeps`` and
``relay_janitor_rows{action}`` (dead_lettered, pruned_deliveries, pruned_attempts).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from relay_trio.db import DatabaseUnavailable
from relay_trio.store.janitor import dead_letter_expired, prune_delivered_tx
from relay_trio.store.locks import Lease, acquire_lock, release_lock, renew_lock

log = logging.getLogger("relay_trio.janitor")

LOCK_NAME = "janitor"
LOCK_TTL = 30.0   # seconds; renewed after every batch, so only a dead pod's lease runs out
BATCH = 500       # rows per statement


class LockLost(Exception):
    """The janitor lease expired and was taken (or freed) while sweeping."""


@dataclass
class SweepResult:
    dead_lettered: int = 0
    pruned_deliveries: int = 0
    pruned_attempts: int = 0
    complete: bool = True  # False when the lease was lost mid-sweep


class Janitor:
    """One pod's janitor: ``run_once`` is one sweep attempt, ``run`` the interval loop."""

    def __init__(self, pod, *, lock_ttl: float = LOCK_TTL, batch: int = BATCH):
        self.pod = pod
        self.lock_ttl = lock_ttl
        self.batch = batch
        self.sweeps = 0
        self.skipped = 0  # attempts that found the lock held by another pod
        self.last: SweepResult | None = None
        # (start, end) of recent sweeps on trio's clock: lets tests check exclusivity.
        self.history: deque[tuple[float, float]] = deque(maxlen=200)
        # Test hook: awaited mid-sweep (after dead-lettering, before pruning), under the lock.
        self.on_sweep: Callable[[], Awaitable[None]] | None = None

    async def run_once(self) -> SweepResult | None:
        """Sweep if the ``janitor`` lock can be taken now; None when another pod holds it."""
        db = self.pod.db
        lease = await db.run(acquire_lock, LOCK_NAME, self.lock_ttl, self.pod.pod_id)
        if lease is None:
            self.skipped += 1
            return None
        start = trio.current_time()
        result = SweepResult()
        try:
            lease = await self._sweep(lease, result)
        except LockLost:
            result.complete = False
            log.warning("janitor lease lost mid-sweep; stopping", extra={"pod": self.pod.pod_id})
            lease = None
        finally:
            self.history.append((start, trio.current_time()))
            self._record(result)
            if lease is not None:
                await self._release(lease)
        return result

    async def _sweep(self, lease: Lease, result: SweepResult) -> Lease:
        settings = self.pod.settings
        db = self.pod.db
        while True:
            n = await db.run(dead_letter_expired, settings.delivery_retention, self.batch)
            result.dead_lettered += n
            lease = await self._renew(lease)
            if n < self.batch:
                break
        if self.on_sweep is not None:
            await self.on_sweep()
            lease = await self._renew(lease)
        while True:
            rows, attempts = await db.run_tx(prune_delivered_tx, settings.delivered_retention, self.batch)
            result.pruned_deliveries += rows
            result.pruned_attempts += attempts
            lease = await self._renew(lease)
            if rows < self.batch:
                break
        return lease

    async def _renew(self, lease: Lease) -> Lease:
        renewed = await self.pod.db.run(renew_lock, lease, self.lock_ttl)
        if renewed is None:
            raise LockLost
        return renewed

    async def _release(self, lease: Lease) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(2.0):
            try:
                await self.pod.db.run(release_lock, lease)
            except DatabaseUnavailable as exc:
                log.warning("janitor lock release failed (it expires by itself): %s", exc)

    def _record(self, result: SweepResult) -> None:
        self.sweeps += 1
        self.last = result
        metrics = self.pod.metrics
        metrics.janitor_sweeps.inc()
        for action in ("dead_lettered", "pruned_deliveries", "pruned_attempts"):
            count = getattr(result, action)
            if count:
                metrics.janitor_rows.labels(action=action).inc(count)
        if result.dead_lettered or result.pruned_deliveries:
            log.info(
                "janitor sweep",
                extra={
                    "pod": self.pod.pod_id,
                    "dead_lettered": result.dead_lettered,
                    "pruned_deliveries": result.pruned_deliveries,
                    "pruned_attempts": result.pruned_attempts,
                },
            )

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        interval = self.pod.settings.janitor_interval
        while True:
            try:
                await self.run_once()
            except DatabaseUnavailable as exc:
                log.warning("janitor sweep skipped: %s", exc, extra={"pod": self.pod.pod_id})
            await trio.sleep(interval)


async def janitor_component(pod, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The pod's janitor (kept across supervised restarts, so its counters survive)."""
    if pod.janitor is None:
        pod.janitor = Janitor(pod)
    await pod.janitor.run(task_status=task_status)
