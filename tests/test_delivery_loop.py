"""The production run_delivery_loop, driven with a fake store and sender under autojump_clock.

The fake store mirrors the claim contract (due, not leased, per-listener budgets, limit)
in memory and records every claim; the fake sender records concurrency and can stall a
listener until a gate opens. No database, no sockets: timing assertions use trio's clock.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from datetime import datetime, timezone

import pytest
import trio

from relay_trio.db import DatabaseUnavailable
from relay_trio.delivery import model
from relay_trio.delivery.loop import LoopConfig, run_delivery_loop

CFG = LoopConfig(max_in_flight=10, listener_share=0.5, poll_min=0.25, poll_max=2.0)


class FakeStore:
    def __init__(self, sender: "FakeSender | None" = None, limit_for_check: int | None = None):
        self.rows: dict[int, dict] = {}
        self.sender = sender
        self.limit_for_check = limit_for_check
        self.fail_by_id = False
        self.claim_log: list[tuple[str, float, int]] = []  # (path, time, rows)
        self.violations: list[str] = []
        self.delivered_at: dict[int, float] = {}
        self.via: dict[int, str] = {}
        self.released: list[int] = []
        self.changed = trio.lowlevel.ParkingLot()
        self.token = 0

    def add(self, rid: int, listener: str = "bot") -> None:
        self.rows[rid] = {"listener": listener, "leased": False, "status": "pending", "attempts": 0}

    def _check_slots(self, requested: int) -> None:
        if self.sender is not None and self.limit_for_check is not None:
            if self.sender.active + requested > self.limit_for_check:
                self.violations.append(f"claim of {requested} with {self.sender.active} in flight")

    def _claim(self, path, limit, budgets, default, ids=None):
        used = collections.Counter()
        out = []
        for rid in sorted(self.rows):
            r = self.rows[rid]
            if r["status"] != "pending" or r["leased"] or (ids is not None and rid not in ids):
                continue
            if budgets.get(r["listener"], default) - used[r["listener"]] <= 0:
                continue
            used[r["listener"]] += 1
            r["leased"] = True
            r["attempts"] += 1
            self.token += 1
            self.via[rid] = path
            out.append(model.ClaimedRow(id=rid, listener=r["listener"], attempt=r["attempts"], token=self.token))
            if len(out) == limit:
                break
        self.claim_log.append((path, trio.current_time(), len(out)))
        return out

    async def claim_by_id(self, ids, limit, budgets, default_budget):
        self._check_slots(len(ids))
        await trio.sleep(0)
        if self.fail_by_id:
            self.claim_log.append(("handoff-failed", trio.current_time(), 0))
            raise DatabaseUnavailable("by-id claim failed on purpose")
        return self._claim("handoff", limit, budgets, default_budget, ids=set(ids))

    async def claim_due(self, limit, budgets, default_budget, *, via="poll"):
        self._check_slots(limit)
        await trio.sleep(0)
        return self._claim(via, limit, budgets, default_budget)

    async def settle(self, row, result):
        await trio.sleep(0)
        r = self.rows[row.id]
        r["leased"] = False
        r["status"] = "delivered"
        self.delivered_at[row.id] = trio.current_time()
        self.changed.unpark_all()
        return model.Settled("delivered", 0.0)

    async def release(self, rows):
        for row in rows:
            self.rows[row.id]["leased"] = False
            self.released.append(row.id)
        return len(rows)

    async def wait_delivered(self, *ids: int, timeout: float = 60) -> None:
        with trio.fail_after(timeout):
            while not all(i in self.delivered_at for i in ids):
                await self.changed.park()


class FakeSender:
    def __init__(self, latency: float = 0.01):
        self.latency = latency
        self.active = 0
        self.max_active = 0
        self.active_per_listener: collections.Counter[str] = collections.Counter()
        self.max_per_listener: collections.Counter[str] = collections.Counter()
        self.stalled: set[str] = set()
        self.gate = trio.Event()
        self.latency_for: dict[str, float] = {}

    async def send(self, row):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.active_per_listener[row.listener] += 1
        self.max_per_listener[row.listener] = max(
            self.max_per_listener[row.listener], self.active_per_listener[row.listener]
        )
        try:
            if row.listener in self.stalled:
                await self.gate.wait()
            await trio.sleep(self.latency_for.get(row.listener, self.latency))
            return model.AttemptResult(model.DELIVERED, datetime.now(timezone.utc), 1.0, status_code=200)
        finally:
            self.active -= 1
            self.active_per_listener[row.listener] -= 1


async def start_loop(nursery, store, sender, config=CFG, *, handoff=None, wakes=None):
    return await nursery.start(functools.partial(run_delivery_loop, store, sender, config, handoff=handoff, wakes=wakes))


async def test_handed_off_row_is_claimed_by_id_before_any_idle_poll(autojump_clock):
    sender = FakeSender()
    store = FakeStore()
    send, recv = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, store, sender, handoff=recv)
        await trio.sleep(10)  # idle: the poll interval has grown to its 2 s ceiling
        t0 = trio.current_time()
        store.add(1)
        send.send_nowait(1)
        await store.wait_delivered(1)
        assert store.via[1] == "handoff"
        assert store.delivered_at[1] - t0 < 0.1
        nursery.cancel_scope.cancel()


async def test_row_never_handed_off_is_delivered_by_the_poll(autojump_clock):
    sender = FakeSender()
    store = FakeStore()
    send, recv = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, store, sender, handoff=recv)
        await trio.sleep(10)
        t0 = trio.current_time()
        store.add(7)
        await store.wait_delivered(7)
        assert store.via[7] == "poll"
        assert store.delivered_at[7] - t0 <= CFG.poll_max + 0.1
        nursery.cancel_scope.cancel()


async def test_failed_by_id_claim_is_covered_by_the_poll(autojump_clock):
    sender = FakeSender()
    store = FakeStore()
    store.fail_by_id = True
    send, recv = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, store, sender, handoff=recv)
        await trio.sleep(1)
        store.add(3)
        send.send_nowait(3)
        await store.wait_delivered(3)
        assert any(path == "handoff-failed" for path, _, _ in store.claim_log)
        assert store.via[3] == "poll"
        nursery.cancel_scope.cancel()


async def test_notify_wake_claims_at_once(autojump_clock):
    sender = FakeSender()
    store = FakeStore()
    wake_send, wake_recv = trio.open_memory_channel(10)
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, store, sender, wakes=wake_recv)
        await trio.sleep(10)
        t0 = trio.current_time()
        store.add(4)
        wake_send.send_nowait(None)  # "re-read everything" (a reconnect) or a NOTIFY
        await store.wait_delivered(4)
        assert store.via[4] == "notify"
        assert store.delivered_at[4] - t0 < 0.1
        nursery.cancel_scope.cancel()


async def test_fast_handoffs_do_not_push_the_poll_back(autojump_clock):
    sender = FakeSender()
    store = FakeStore()
    send, recv = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, store, sender, handoff=recv)

        async def handoffs():
            for i in range(100, 160):  # one every 100 ms for 6 s, faster than the poll interval
                store.add(i)
                send.send_nowait(i)
                await trio.sleep(0.1)

        nursery.start_soon(handoffs)
        await trio.sleep(1.0)
        t0 = trio.current_time()
        store.add(1)  # never handed off: only a poll finds it
        await store.wait_delivered(1)
        assert store.via[1] == "poll"
        assert store.delivered_at[1] - t0 <= CFG.poll_min + 0.1
        polls = [t for path, t, _ in store.claim_log if path == "poll"]
        assert len(polls) >= 4
        nursery.cancel_scope.cancel()


async def test_stalled_delivery_does_not_hold_up_a_later_row(autojump_clock):
    sender = FakeSender()
    sender.stalled.add("slow")
    store = FakeStore()
    send, recv = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, store, sender, handoff=recv)
        store.add(1, "slow")
        send.send_nowait(1)
        await trio.sleep(0.1)
        t0 = trio.current_time()
        store.add(2, "fast")
        send.send_nowait(2)
        await store.wait_delivered(2, timeout=5)
        assert store.delivered_at[2] - t0 < 0.1
        store.add(3, "fast")  # and the poll path too
        await store.wait_delivered(3, timeout=5)
        assert 1 not in store.delivered_at
        nursery.cancel_scope.cancel()


async def test_in_flight_never_exceeds_the_limit_and_no_claim_without_a_free_slot(autojump_clock):
    config = LoopConfig(max_in_flight=3, listener_share=1.0, poll_min=0.25, poll_max=2.0)
    sender = FakeSender()
    sender.stalled.add("bot")
    store = FakeStore(sender, limit_for_check=3)
    send, recv = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, store, sender, config, handoff=recv)
        for i in range(1, 11):
            store.add(i)
            send.send_nowait(i)
        for i in range(11, 16):
            store.add(i)  # poll-only rows as well
        await trio.sleep(5)
        assert sender.active == 3
        # The loop stopped reading hand-offs while every slot was busy.
        assert recv.statistics().current_buffer_used == 7
        sender.gate.set()
        await store.wait_delivered(*range(1, 16))
        assert sender.max_active == 3
        assert store.violations == []
        nursery.cancel_scope.cancel()


async def test_one_listener_gets_at_most_its_share_of_slots(autojump_clock):
    config = LoopConfig(max_in_flight=4, listener_share=0.5, poll_min=0.25, poll_max=2.0)
    sender = FakeSender()
    sender.stalled.add("slow")
    store = FakeStore()
    send, recv = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, store, sender, config, handoff=recv)
        for i in range(1, 7):
            store.add(i, "slow")
            send.send_nowait(i)
        await trio.sleep(3)
        assert sender.max_per_listener["slow"] == 2
        store.add(10, "fast")
        send.send_nowait(10)
        await store.wait_delivered(10, timeout=5)
        sender.gate.set()
        await store.wait_delivered(*range(1, 7))
        assert sender.max_per_listener["slow"] == 2
        nursery.cancel_scope.cancel()


async def test_shutdown_stops_claiming_waits_the_grace_then_releases(autojump_clock):
    sender = FakeSender()
    sender.latency_for["ok"] = 0.5
    sender.stalled.add("stuck")
    store = FakeStore()
    send, recv = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        loop = await start_loop(nursery, store, sender, handoff=recv)
        store.add(1, "ok")
        store.add(2, "stuck")
        send.send_nowait(1)
        send.send_nowait(2)
        await trio.sleep(0.1)
        assert sender.active == 2
        t0 = trio.current_time()
        claims_before = len(store.claim_log)
        result = {}
        done = trio.Event()

        async def stop():
            result["released"] = await loop.shutdown(1.0)
            result["took"] = trio.current_time() - t0
            done.set()

        nursery.start_soon(stop)
        await trio.sleep(0.3)
        store.add(3, "ok")  # arrives during the grace: must not be claimed
        send.send_nowait(3)
        await done.wait()
        assert 1.0 <= result["took"] < 1.6
        assert 1 in store.delivered_at  # finished within the grace
        assert result["released"] == 1 and store.released == [2]  # cancelled, lease given back
        await trio.sleep(5)
        assert len(store.claim_log) == claims_before  # no claim after shutdown began
        assert 3 not in store.delivered_at
        nursery.cancel_scope.cancel()


async def test_a_busy_listener_is_claimed_again_as_its_slots_free_not_at_the_next_poll(autojump_clock):
    sender = FakeSender(latency=0.01)
    store = FakeStore()
    async with trio.open_nursery() as nursery:
        await start_loop(nursery, store, sender)
        await trio.sleep(10)  # idle poll interval: 2 s
        for i in range(1, 31):
            store.add(i, "bot")  # 30 rows, one listener, budget 5 of 10 slots
        await store.wait_delivered(*range(1, 31))
        first_claim = min(t for path, t, n in store.claim_log if n)
        assert max(store.delivered_at.values()) - first_claim < 0.25  # well before the next poll
        assert sender.max_per_listener["bot"] == 5
        nursery.cancel_scope.cancel()


async def test_metrics_claims_wake_misses_in_flight_and_outcomes(autojump_clock):
    from relay_trio.metrics import Metrics

    metrics = Metrics()
    sender = FakeSender()
    store = FakeStore()
    orig = store._claim

    def overdue_claim(*args, **kwargs):
        return [dataclasses.replace(r, overdue_seconds=30.0, age_seconds=30.0) for r in orig(*args, **kwargs)]

    store._claim = overdue_claim
    send, recv = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(run_delivery_loop, store, sender, CFG, handoff=recv, metrics=metrics))
        store.add(1)
        send.send_nowait(1)
        await store.wait_delivered(1)
        store.add(2)
        await store.wait_delivered(2)
        await trio.sleep(0.1)
        value = lambda name, **labels: metrics.registry.get_sample_value(name, labels)  # noqa: E731
        assert value("relay_claims_total", path="handoff") == 1
        assert value("relay_claims_total", path="poll") == 1
        assert value("relay_wake_misses_total") == 1  # only the poll-claimed overdue row
        assert value("relay_deliveries_total", outcome="delivered") == 2
        assert value("relay_deliveries_in_flight") == 0
        assert value("relay_commit_to_claim_seconds_count", path="handoff") == 1
        nursery.cancel_scope.cancel()


async def test_rows_held_back_by_the_listener_share_are_not_wake_misses(autojump_clock):
    """A backlog of one listener is claimed as its slots free: that is fairness, not a lost
    wake-up, so only the timer poll's own overdue rows count as wake misses."""
    from relay_trio.metrics import Metrics

    metrics = Metrics()
    sender = FakeSender(latency=0.05)
    store = FakeStore()
    orig = store._claim

    def overdue_claim(*args, **kwargs):
        return [dataclasses.replace(r, overdue_seconds=30.0, age_seconds=30.0) for r in orig(*args, **kwargs)]

    store._claim = overdue_claim
    for rid in range(1, 13):
        store.add(rid)  # one listener: at most 5 of 10 slots (listener_share 0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(run_delivery_loop, store, sender, CFG, metrics=metrics))
        await store.wait_delivered(*range(1, 13))
        value = lambda name, **labels: metrics.registry.get_sample_value(name, labels)  # noqa: E731
        assert value("relay_claims_total", path="poll") == 12
        assert value("relay_wake_misses_total") == 5  # the timer poll's first round only
        nursery.cancel_scope.cancel()
