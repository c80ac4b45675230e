"""The delivery loop: one per pod. Wake paths in, claims, one bounded delivery nursery.

Three wake paths feed claims:

* hand-off: ids from this pod's intake (a trio channel). Read only while a delivery slot is
  free, and claimed by id only with slots already taken, so a burst never over-claims.
* notify: a NOTIFY from another pod (or "re-read everything" after a LISTEN reconnect)
  triggers a due-claim at once.
* poll: a due-claim on a fixed deadline: ``poll_min`` after activity, doubling to
  ``poll_max`` while idle. Hand-offs never push the deadline back (they can only pull it
  closer), so a steady stream of hand-offs cannot starve rows that only the poll finds.

Every claimed row runs as its own task in the delivery nursery, holding one token of a
``trio.CapacityLimiter(max_in_flight)``; the loop claims again whenever a slot frees and a
backlog may exist, never waiting for a batch. At most ``ceil(max_in_flight *
listener_share)`` slots serve one listener, so a stalled endpoint cannot take them all.

The loop's collaborators are parameters (a store with claim_by_id / claim_due / settle /
release, and a sender with ``send(row)``) so tests drive this production code with fakes
under trio's autojump clock. ``delivery_component`` wires the real ones for a pod.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from relay_trio import channels
from relay_trio.db import DatabaseUnavailable
from relay_trio.delivery import model

log = logging.getLogger("relay_trio.delivery.loop")


# A due-claim started because a slot freed while a backlog was known (not a wake, not
# the timer). Reported as "poll" in metrics and claimed_via.
BACKLOG = "backlog"


def _label(path: str) -> str:
    return "poll" if path == BACKLOG else path


def _log_fields(row: model.ClaimedRow) -> dict[str, Any]:
    """The ids a delivery's log lines carry (never the event body)."""
    return {"delivery_id": row.id, "event_id": row.event.get("id"), "listener": row.listener}


class DeliveryStore(Protocol):
    async def claim_by_id(
        self, ids: Sequence[int], limit: int, budgets: Mapping[str, int], default_budget: int
    ) -> list[model.ClaimedRow]: ...

    async def claim_due(
        self, limit: int, budgets: Mapping[str, int], default_budget: int, *, via: str = "poll"
    ) -> list[model.ClaimedRow]: ...

    async def settle(self, row: model.ClaimedRow, result: model.AttemptResult) -> model.Settled: ...

    async def release(self, rows: Sequence[model.ClaimedRow]) -> int: ...


class Sender(Protocol):
    async def send(self, row: model.ClaimedRow) -> model.AttemptResult: ...


@dataclass(frozen=True)
class LoopConfig:
    max_in_flight: int = 10
    listener_share: float = 0.5
    poll_min: float = 0.25
    poll_max: float = 2.0

    @property
    def per_listener(self) -> int:
        return max(1, math.ceil(self.max_in_flight * self.listener_share))

    @classmethod
    def from_settings(cls, settings: Any) -> LoopConfig:
        return cls(
            max_in_flight=settings.max_in_flight,
            listener_share=settings.listener_share,
            poll_min=settings.poll_min,
            poll_max=max(settings.poll_max, settings.poll_min),
        )


class Slots:
    """In-flight slots: a CapacityLimiter plus a way to wait until one is free (or all are)."""

    def __init__(self, total: int):
        self.limiter = trio.CapacityLimiter(total)
        self._changed = trio.lowlevel.ParkingLot()

    @property
    def free(self) -> int:
        return int(self.limiter.available_tokens)

    @property
    def in_use(self) -> int:
        return int(self.limiter.borrowed_tokens)

    async def take(self) -> object:
        token = object()
        await self.limiter.acquire_on_behalf_of(token)
        return token

    def take_nowait(self) -> object | None:
        token = object()
        try:
            self.limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            return None
        return token

    def give_back(self, token: object) -> None:
        self.limiter.release_on_behalf_of(token)
        self._changed.unpark_all()

    async def wait_free(self) -> None:
        while self.free == 0:
            await self._changed.park()

    async def wait_all_free(self) -> None:
        while self.in_use:
            await self._changed.park()


class DeliveryLoop:
    """State of one pod's delivery loop; ``pod.delivery`` is this object."""

    def __init__(
        self,
        store: DeliveryStore,
        sender: Sender,
        config: LoopConfig,
        *,
        handoff: trio.MemoryReceiveChannel[int] | None = None,
        wakes: AsyncIterable[Any] | None = None,
        metrics: Any = None,
        routes: frozenset[str] | None = None,
    ):
        self.store = store
        self.sender = sender
        self.config = config
        self.handoff = handoff
        self.wakes = wakes
        self.metrics = metrics
        self.routes = routes
        self.slots = Slots(config.max_in_flight)
        self.per_listener: collections.Counter[str] = collections.Counter()
        self.outstanding: dict[int, model.ClaimedRow] = {}  # claimed, not yet settled
        self.poll_interval = config.poll_min
        self.next_poll = trio.current_time() + config.poll_min
        self.stopping = False
        self._backlog = False  # a due-claim may find more rows once a slot frees
        self._kick = trio.Event()
        self._kick_path: str | None = None
        self._poll_wait: trio.CancelScope | None = None
        self._claiming = trio.CancelScope()
        self._deliveries: trio.Nursery | None = None
        self.counts: collections.Counter[str] = collections.Counter()  # for status() and tests

    # -- status ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "in_flight": self.slots.in_use,
            "max_in_flight": self.config.max_in_flight,
            "poll_interval": self.poll_interval,
            "stopping": self.stopping,
            **{k: v for k, v in self.counts.items()},
        }

    # -- the loop ----------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as deliveries:
            self._deliveries = deliveries
            with self._claiming:
                async with trio.open_nursery() as claimers:
                    claimers.start_soon(self._poll_task)
                    if self.handoff is not None:
                        claimers.start_soon(self._handoff_task)
                    if self.wakes is not None:
                        claimers.start_soon(self._wake_task)
                    task_status.started(self)
            # Claiming stopped (shutdown): deliveries drain or are cancelled by shutdown().
        # Returning would make the supervisor restart the loop: stay idle until cancelled.
        await trio.sleep_forever()

    def _budgets(self) -> dict[str, int]:
        cap = self.config.per_listener
        return {name: max(0, cap - n) for name, n in self.per_listener.items() if n}

    def kick(self, path: str) -> None:
        """Ask for a due-claim now (notify wake, or a slot freed with a backlog)."""
        if self._kick_path is None or path == "notify":
            self._kick_path = path
        self._kick.set()

    def note_activity(self) -> None:
        """Activity: poll soon (``poll_min``); only ever pulls the poll deadline closer."""
        self.poll_interval = self.config.poll_min
        self.next_poll = min(self.next_poll, trio.current_time() + self.config.poll_min)
        if self._poll_wait is not None:
            self._poll_wait.deadline = self.next_poll

    async def _poll_task(self) -> None:
        self.next_poll = trio.current_time() + self.poll_interval
        while True:
            with trio.CancelScope(deadline=self.next_poll) as self._poll_wait:
                await self._kick.wait()
            self._poll_wait = None
            path = "poll"
            if self._kick.is_set():
                path = self._kick_path or "poll"
                self._kick = trio.Event()
                self._kick_path = None
            timer_due = trio.current_time() >= self.next_poll
            found = await self._claim_due_round(path)
            if timer_due:
                cfg = self.config
                self.poll_interval = cfg.poll_min if found else min(self.poll_interval * 2, cfg.poll_max)
                self.next_poll = trio.current_time() + self.poll_interval

    async def _claim_due_round(self, path: str) -> int:
        """Claim due rows up to the free slots; again at once while every slot got a row."""
        found = 0
        while not self.stopping:
            taken: list[object] = []
            while (slot := self.slots.take_nowait()) is not None:
                taken.append(slot)
            if not taken:
                self._backlog = True
                break
            budgets = self._budgets()
            try:
                rows = await self._claim(self.store.claim_due, len(taken), budgets, self.config.per_listener,
                                         via=_label(path))
            except DatabaseUnavailable as exc:
                log.warning("claim_due failed: %s; the next poll retries", exc)
                rows = []
            except Exception:
                log.exception("claim_due failed; the next poll retries")
                rows = []
            self.counts[f"claim_due_{_label(path)}"] += 1
            self._start_all(rows, taken, path)
            found += len(rows)
            per = collections.Counter(row.listener for row in rows)
            # A listener that used its whole budget may have more due rows: claim again as
            # soon as one of its deliveries frees a slot, not at the next poll.
            capped = any(n >= budgets.get(name, self.config.per_listener) for name, n in per.items())
            self._backlog = len(rows) == len(taken) or capped
            if len(rows) < len(taken):
                break
        return found

    async def _claim(self, claim: Any, *args: Any, **kwargs: Any) -> list[model.ClaimedRow]:
        """Run one claim shielded from shutdown's cancel (the store bounds it with its own
        deadline): a claim that committed must not lose its rows. If shutdown began
        meanwhile, the rows go straight back (release) instead of starting."""
        with trio.CancelScope(shield=True):
            rows = await claim(*args, **kwargs)
            if self.stopping and rows:
                await self.store.release(rows)
                return []
        return rows

    async def _handoff_task(self) -> None:
        assert self.handoff is not None
        carry: list[int] = []
        while True:
            if not carry:
                # Read the channel only while a slot is free.
                await self.slots.wait_free()
                try:
                    carry.append(await self.handoff.receive())
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                self.note_activity()
            taken = [await self.slots.take()]  # never claim without a slot in hand
            while len(carry) < len(taken) + self.slots.free:
                try:
                    carry.append(self.handoff.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
            while len(taken) < len(carry) and (slot := self.slots.take_nowait()) is not None:
                taken.append(slot)
            ids, carry = carry[: len(taken)], carry[len(taken):]
            try:
                rows = await self._claim(self.store.claim_by_id, ids, len(ids), self._budgets(), self.config.per_listener)
            except DatabaseUnavailable as exc:
                log.warning("claim_by_id failed: %s; the poll will find the rows", exc, extra={"delivery_ids": ids})
                rows = []
            except Exception:
                log.exception("claim_by_id failed; the poll will find the rows", extra={"delivery_ids": ids})
                rows = []
            self.counts["claim_by_id"] += 1
            if len(rows) < len(ids):
                # Over budget, already claimed elsewhere, or the claim failed: let a
                # due-claim look again when a slot frees (and the poll in any case).
                self._backlog = True
            self._start_all(rows, taken, "handoff")

    async def _wake_task(self) -> None:
        assert self.wakes is not None
        async for wake in self.wakes:
            if self._wake_is_for_us(wake):
                self.note_activity()
                self.kick("notify")

    def _wake_is_for_us(self, wake: Any) -> bool:
        """A payload naming only listeners this pod does not route is ignored."""
        if wake is None or getattr(wake, "reconnect", False) or self.routes is None:
            return True
        payload = getattr(wake, "payload", wake if isinstance(wake, str) else None)
        if not isinstance(payload, str) or not payload:
            return True
        return any(name.strip() in self.routes for name in payload.split(","))

    # -- deliveries ----------------------------------------------------------------------------
    def _start_all(self, rows: Sequence[model.ClaimedRow], slots: list[object], path: str) -> None:
        for row, slot in zip(rows, slots):
            self._start(row, slot, path)
        for slot in slots[len(rows):]:
            self.slots.give_back(slot)

    def _start(self, row: model.ClaimedRow, slot: object, path: str) -> None:
        assert self._deliveries is not None
        m = self.metrics
        label = _label(path)
        if m is not None:
            m.claims.labels(path=label).inc()
            if row.attempt == 1:
                m.commit_to_claim.labels(path=label).observe(max(0.0, row.age_seconds))
            # A lost wake-up: the timer poll found a row that had been claimable (due, not
            # leased, listener not paused: see overdue_seconds in the claim SQL) for longer
            # than the poll ceiling. Rows held back by the per-listener share and claimed as
            # a slot frees (BACKLOG) are fairness, not a lost wake.
            if path == "poll" and row.overdue_seconds > self.config.poll_max:
                m.wake_misses.inc()
            m.in_flight.inc()
        self.counts[f"claimed_{label}"] += 1
        self.outstanding[row.id] = row
        self.per_listener[row.listener] += 1
        self._deliveries.start_soon(self._deliver, row, slot, name=f"deliver-{row.id}")

    async def _deliver(self, row: model.ClaimedRow, slot: object) -> None:
        try:
            result = await self.sender.send(row)
            settled = await self.store.settle(row, result)
            self.outstanding.pop(row.id, None)
            self.counts[settled.result] += 1
            if self.metrics is not None:
                if settled.result in ("delivered", "retried", "dead"):
                    self.metrics.deliveries.labels(outcome=settled.result).inc()
                if settled.delivered_age is not None:
                    self.metrics.commit_to_delivered.observe(max(0.0, settled.delivered_age))
            level = logging.DEBUG if settled.result == "delivered" else logging.INFO
            if settled.result == "dead":
                level = logging.WARNING
            # Every success logs at DEBUG, which is off in production: check the level
            # before building the record's extra fields (this runs once per delivery).
            if log.isEnabledFor(level):
                log.log(
                    level, "delivery %s: %s (%s)", settled.result, result.outcome, result.error or result.status_code,
                    extra={**_log_fields(row), "attempt": row.attempt, "outcome": result.outcome,
                           "status_code": result.status_code},
                )
        except DatabaseUnavailable as exc:
            # The lease expires and the row is claimed again (at least once).
            self.outstanding.pop(row.id, None)
            log.warning("delivery not settled: %s; its lease will expire", exc, extra=_log_fields(row))
        except Exception:
            # Never take the loop down; the lease expires and the row is claimed again.
            self.outstanding.pop(row.id, None)
            log.exception("delivery failed to settle; its lease will expire", extra=_log_fields(row))
        finally:
            # Cancelled (shutdown): the row stays in ``outstanding`` for release().
            self.per_listener[row.listener] -= 1
            if self.per_listener[row.listener] <= 0:
                del self.per_listener[row.listener]
            if self.metrics is not None:
                self.metrics.in_flight.dec()
            self.slots.give_back(slot)
            if self._backlog and not self.stopping:
                self.kick(BACKLOG)

    # -- shutdown ------------------------------------------------------------------------------
    async def shutdown(self, grace: float) -> int:
        """Stop claiming now, give in-flight deliveries ``grace`` seconds, cancel the rest,
        then release (fencing-checked) every lease still held so other pods claim at once.

        Returns how many leases were released.
        """
        self.stopping = True
        self._claiming.cancel()
        with trio.move_on_after(grace):
            await self.slots.wait_all_free()
        if self._deliveries is not None:
            self._deliveries.cancel_scope.cancel()
        with trio.move_on_after(0.5):  # cancelled deliveries unwind at once
            await self.slots.wait_all_free()
        leftovers = list(self.outstanding.values())
        self.outstanding.clear()
        if not leftovers:
            return 0
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                released = await self.store.release(leftovers)
            except Exception:
                log.exception("releasing leases at shutdown failed; they expire on their own")
                return 0
            log.info("released %d leases at shutdown", released, extra={"delivery_ids": [r.id for r in leftovers]})
            return released
        return 0


async def run_delivery_loop(
    store: DeliveryStore,
    sender: Sender,
    config: LoopConfig,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """Run the production delivery loop; ``task_status.started(loop)`` hands back its state.

    ``options`` are DeliveryLoop's keyword arguments (handoff, wakes, metrics, routes).
    """
    loop = DeliveryLoop(store, sender, config, **options)
    await loop.run(task_status=task_status)


# -- the pod component ------------------------------------------------------------------------
async def pglistener_wakes(pod: Any) -> AsyncIterator[Any]:
    """Wakes on the outbox channel from ``pod.pglistener``; re-subscribes if it goes away.

    A subscription's first wake is a "reconnect" (re-read everything): notifications sent
    while we were not subscribed are gone, so the loop claims due rows.
    """
    while True:
        listener = pod.pglistener
        if listener is None:
            await trio.sleep(1.0)
            continue
        sub = None
        try:
            sub = listener.subscribe(channels.OUTBOX)
            async for wake in sub:
                yield wake
        except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        except Exception:
            log.exception("outbox subscription failed; re-subscribing")
        finally:
            close = getattr(sub, "close", None)
            if close is not None:
                close()
        await trio.sleep(0.5)


async def delivery_component(pod: Any, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The pod's delivery loop with its real store, sender and HTTP client."""
    from relay_trio.delivery.http_client import make_http_client
    from relay_trio.delivery.pg_store import PgDeliveryStore
    from relay_trio.delivery.sender import HttpSender

    settings = pod.settings
    client = make_http_client(settings)
    try:
        store = PgDeliveryStore(pod.db, settings, pod.pod_id)
        sender = HttpSender(client, timeout=settings.delivery_timeout)
        wakes = pglistener_wakes(pod) if pod.pglistener is not None else None
        loop = DeliveryLoop(
            store, sender, LoopConfig.from_settings(settings),
            handoff=pod.handoff_recv, wakes=wakes, metrics=pod.metrics, routes=settings.route_set,
        )
        pod.delivery = loop
        await loop.run(task_status=task_status)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            await client.aclose()
