"""Claims against real PostgreSQL: exactly-once claiming, SKIP LOCKED, routes, budgets, fencing."""

from __future__ import annotations

import collections
import functools
import random

import trio

from delivery_support import add_listener, add_rows, execute, fetch
from relay_trio.db import connect_dedicated, on_connection
from relay_trio.store import claims


def spec(owner="pod-a", *, routes=None, limit=10, via="poll", budgets=None, default_budget=100):
    return claims.ClaimSpec(owner=owner, lease_seconds=30.0, routes=routes, limit=limit, via=via,
                            budgets=budgets or {}, default_budget=default_budget)


async def test_pollers_and_by_id_claimers_race_every_row_claimed_once(db):
    await add_listener(db, "bot")
    ids = await add_rows(db, ["bot"] * 200)
    claimed: list[int] = []

    async def poller(n):
        while True:
            rows = await db.run(claims.claim_due, spec(f"poller-{n}", limit=5))
            if not rows:
                return
            claimed.extend(r["id"] for r in rows)
            await trio.sleep(0)

    async def by_id(n):
        order = ids[:]
        random.Random(n).shuffle(order)
        for i in range(0, len(order), 4):
            rows = await db.run(claims.claim_by_id, spec(f"byid-{n}", via="handoff"), order[i:i + 4])
            claimed.extend(r["id"] for r in rows)

    async with trio.open_nursery() as nursery:
        for n in range(4):
            nursery.start_soon(poller, n)
            nursery.start_soon(by_id, n)

    counts = collections.Counter(claimed)
    assert sorted(counts) == sorted(ids)
    assert set(counts.values()) == {1}, [i for i, c in counts.items() if c > 1][:10]
    rows = await fetch(db, "SELECT attempts, lease_token, lease_owner FROM deliveries")
    assert {r["attempts"] for r in rows} == {1}
    assert len({r["lease_token"] for r in rows}) == 200  # a fresh fencing token per claim
    # A leased row cannot be claimed again, by id or by the poll.
    assert await db.run(claims.claim_by_id, spec("late", via="handoff"), ids) == []
    assert await db.run(claims.claim_due, spec("late")) == []


async def test_a_row_locked_by_another_claim_is_skipped_not_waited_for(db, database_url):
    await add_listener(db, "bot")
    ids = await add_rows(db, ["bot"] * 3)
    conn = await connect_dedicated(database_url, "holder")
    try:
        async def hold(c):
            await c.execute("BEGIN")
            await c.execute("SELECT id FROM deliveries WHERE id = $1 FOR UPDATE", ids[0])

        await on_connection(conn, hold)
        with trio.fail_after(3):  # without SKIP LOCKED this blocks until the holder ends
            rows = await db.run(claims.claim_due, spec(limit=10), timeout=10)
            by_id = await db.run(claims.claim_by_id, spec(via="handoff"), [ids[0]], timeout=10)
        assert sorted(r["id"] for r in rows) == ids[1:]
        assert by_id == []

        async def rollback(c):
            await c.execute("ROLLBACK")

        await on_connection(conn, rollback)
    finally:
        await on_connection(conn, lambda c: c.close())
    rows = await db.run(claims.claim_by_id, spec(via="handoff"), [ids[0]])
    assert [r["id"] for r in rows] == [ids[0]]


async def test_unroutable_handoff_leaves_row_claimable_by_a_routing_pod(db):
    await add_listener(db, "a")
    await add_listener(db, "b")
    [row_b] = await add_rows(db, ["b"])
    pod_a = spec("pod-a", routes=frozenset({"a"}), via="handoff")
    assert await db.run(claims.claim_by_id, pod_a, [row_b]) == []
    assert await db.run(claims.claim_due, spec("pod-a", routes=frozenset({"a"}))) == []
    [state] = await fetch(db, "SELECT attempts, lease_owner, lease_until FROM deliveries WHERE id = $1", row_b)
    assert state == {"attempts": 0, "lease_owner": None, "lease_until": None}
    rows = await db.run(claims.claim_due, spec("pod-b", routes=frozenset({"b"})))
    assert [(r["id"], r["attempts"]) for r in rows] == [(row_b, 1)]


async def test_disabled_missing_and_paused_listeners_are_not_claimable(db):
    await add_listener(db, "off", enabled=False)
    await add_listener(db, "paused")
    await add_listener(db, "ok")
    await add_rows(db, ["off", "paused", "ghost", "ok"])
    await execute(db, "UPDATE listeners SET paused_until = now() + interval '1 hour' WHERE name = 'paused'")
    rows = await db.run(claims.claim_due, spec())
    assert [r["listener"] for r in rows] == ["ok"]


async def test_claim_respects_per_listener_budgets(db):
    await add_listener(db, "busy")
    await add_listener(db, "full")
    await add_listener(db, "calm")
    await add_rows(db, ["busy"] * 5 + ["full"] * 3 + ["calm"] * 5)
    rows = await db.run(claims.claim_due, spec(limit=10, budgets={"busy": 1, "full": 0}, default_budget=2))
    per = collections.Counter(r["listener"] for r in rows)
    assert per == {"busy": 1, "calm": 2}


async def test_stale_fencing_token_cannot_settle_a_reclaimed_row(db):
    await add_listener(db, "bot")
    [rid] = await add_rows(db, ["bot"])
    [first] = await db.run(claims.claim_due, spec("pod-old"))
    await execute(db, "UPDATE deliveries SET lease_until = now() - interval '1 second' WHERE id = $1", rid)
    [second] = await db.run(claims.claim_due, spec("pod-new"))
    assert second["lease_token"] != first["lease_token"] and second["attempts"] == 2

    from datetime import datetime, timezone
    attempt = claims.AttemptRecord(rid, 1, "pod-old", datetime.now(timezone.utc), 1.0, "delivered", 200, None, "ok")
    assert await db.run_tx(claims.settle_delivered_tx, rid, first["lease_token"], "bot", attempt) is None
    settle_failed = functools.partial(
        claims.settle_failed_tx, delay=1.0, retention=900.0, failure_threshold=10, pause_for_level=lambda level: 5.0
    )
    status = await db.run_tx(settle_failed, rid, first["lease_token"], "bot", attempt)
    assert status is None
    assert await db.run(claims.release_leases, [(rid, first["lease_token"])]) == 0
    [row] = await fetch(db, "SELECT status, lease_owner, lease_token FROM deliveries WHERE id = $1", rid)
    assert row == {"status": "pending", "lease_owner": "pod-new", "lease_token": second["lease_token"]}
    # The current holder settles it, once.
    assert await db.run_tx(claims.settle_delivered_tx, rid, second["lease_token"], "bot", attempt) is not None
    assert await db.run_tx(claims.settle_delivered_tx, rid, second["lease_token"], "bot", attempt) is None
    [row] = await fetch(db, "SELECT status FROM deliveries WHERE id = $1", rid)
    assert row["status"] == "delivered"


async def test_release_gives_rows_back_at_once(db):
    await add_listener(db, "bot")
    ids = await add_rows(db, ["bot"] * 2)
    rows = await db.run(claims.claim_due, spec("pod-a"))
    assert await db.run(claims.release_leases, [(r["id"], r["lease_token"]) for r in rows]) == 2
    again = await db.run(claims.claim_due, spec("pod-b"))
    assert sorted(r["id"] for r in again) == ids


async def test_failed_settle_and_listener_delete_never_deadlock(db, database_url):
    """Lock order: a settle that changes the listener locks it before any delivery row.

    DELETE /listeners locks the listener, then dead-letters its rows. Here the delete holds
    the listener lock while a failed settle starts; the settle must wait on the listener
    (holding nothing), so the delete's UPDATE of the rows goes through and neither side
    dies of a deadlock. With the old order (rows first) PostgreSQL aborts one of them.
    """
    from datetime import datetime, timezone

    from relay_trio.queries import Q

    await add_listener(db, "bot")
    await add_rows(db, ["bot"])
    [row] = await db.run(claims.claim_due, spec(limit=1))
    deleter = await connect_dedicated(database_url, "deleter")
    try:

        async def delete_listener_only(c):
            await c.execute("BEGIN")
            await c.execute(Q["listener_delete"], "bot")

        await on_connection(deleter, delete_listener_only)
        attempt = claims.AttemptRecord(row["id"], 1, "pod-a", datetime.now(timezone.utc), 1.0, "http_error", 500,
                                       "HTTP 500", None)
        outcome: list = []

        async def settle():
            outcome.append(await db.run_tx(
                functools.partial(claims.settle_failed_tx, delay=1.0, retention=900.0, failure_threshold=10,
                                  pause_for_level=lambda level: 5.0),
                row["id"], row["lease_token"], "bot", attempt, timeout=10,
            ))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(settle)
            await trio.sleep(0.3)  # the settle is now waiting for a lock

            async def dead_letter_rows_and_commit(c):
                await c.execute(Q["deliveries_dead_for_listener"], "bot")
                await c.execute("COMMIT")

            with trio.fail_after(5):
                await on_connection(deleter, dead_letter_rows_and_commit, timeout=5)
        assert outcome == [None], "the settle's token is stale after the delete dead-lettered the row"
    finally:
        await on_connection(deleter, lambda c: c.close())
    [state] = await fetch(db, "SELECT status, dead_reason FROM deliveries WHERE id = $1", row["id"])
    assert state == {"status": "dead", "dead_reason": "listener_deleted"}


async def test_overdue_counts_from_when_the_row_became_claimable(db):
    """The wake-miss metric's input: a row due long ago but leased by a pod that died (or
    whose listener was paused) is not overdue the moment it becomes claimable again."""
    await add_listener(db, "bot")
    [leased, _, plain] = await add_rows(db, ["bot", "bot", "bot"])
    await execute(db, "UPDATE deliveries SET due_at = now() - interval '60 seconds'")
    await execute(db, "UPDATE deliveries SET lease_until = clock_timestamp() - interval '50 milliseconds' WHERE id = $1",
                  leased)
    rows = {r["id"]: r for r in await db.run(claims.claim_due, spec(limit=10))}
    assert rows[leased]["overdue_seconds"] < 5.0
    assert rows[plain]["overdue_seconds"] > 59.0
    # a listener whose pause just ended
    await add_listener(db, "paused")
    [p] = await add_rows(db, ["paused"])
    await execute(db, "UPDATE deliveries SET due_at = now() - interval '60 seconds' WHERE id = $1", p)
    await execute(db, "UPDATE listeners SET paused_until = clock_timestamp() - interval '50 milliseconds' WHERE name = 'paused'")
    [row] = await db.run(claims.claim_due, spec(limit=10))
    assert row["id"] == p and row["overdue_seconds"] < 5.0


async def test_a_backed_off_listener_gets_one_probe_at_a_time(db):
    """After a whole-listener pause ends, one row is claimed (the probe); no other row of
    that listener is claimable while it is leased; a success (backoff_level 0) lifts it."""
    await add_listener(db, "flaky")
    await add_rows(db, ["flaky"] * 4)
    await execute(db, "UPDATE listeners SET backoff_level = 1, consecutive_failures = 10, "
                      "paused_until = clock_timestamp() - interval '1 second' WHERE name = 'flaky'")
    probe = await db.run(claims.claim_due, spec(limit=10))
    assert len(probe) == 1
    assert await db.run(claims.claim_due, spec("other-pod", limit=10)) == []
    await execute(db, "UPDATE listeners SET backoff_level = 0, consecutive_failures = 0, paused_until = NULL "
                      "WHERE name = 'flaky'")
    assert len(await db.run(claims.claim_due, spec(limit=10))) == 3


async def test_one_statement_settle_matches_the_transaction_settle(db):
    """claims.settle_delivered (the hot path, one statement while the listener is clean):
    fencing-checked, records every attempt (stale ones too), settles once; a dirty listener
    goes through the locked transaction and gets its failure state reset."""
    from datetime import datetime, timezone

    await add_listener(db, "bot")
    [rid] = await add_rows(db, ["bot"])
    [first] = await db.run(claims.claim_due, spec("pod-old"))
    await execute(db, "UPDATE deliveries SET lease_until = now() - interval '1 second' WHERE id = $1", rid)
    [second] = await db.run(claims.claim_due, spec("pod-new"))
    attempt = claims.AttemptRecord(rid, 1, "pod-old", datetime.now(timezone.utc), 1.5, "delivered", 200, None, "ok")
    assert await db.run(claims.settle_delivered, rid, first["lease_token"], "bot", attempt) is None
    age = await db.run(claims.settle_delivered, rid, second["lease_token"], "bot", attempt)
    assert age is not None and age >= 0
    assert await db.run(claims.settle_delivered, rid, second["lease_token"], "bot", attempt) is None
    [row] = await fetch(db, "SELECT status, lease_token, delivered_at IS NOT NULL AS done FROM deliveries WHERE id = $1", rid)
    assert row == {"status": "delivered", "lease_token": None, "done": True}
    attempts = await fetch(db, "SELECT attempt, pod_id, duration_ms, outcome, status_code, response_body "
                               "FROM delivery_attempts WHERE delivery_id = $1 ORDER BY id", rid)
    assert len(attempts) == 3
    assert attempts[0] == {"attempt": 1, "pod_id": "pod-old", "duration_ms": 1.5, "outcome": "delivered",
                           "status_code": 200, "response_body": "ok"}

    # A dirty listener: the fallback transaction settles and resets it.
    await add_listener(db, "flaky")
    [rid2] = await add_rows(db, ["flaky"])
    await execute(db, "UPDATE listeners SET consecutive_failures = 3, backoff_level = 1 WHERE name = 'flaky'")
    [claimed] = await db.run(claims.claim_due, spec("pod-a"))
    attempt2 = claims.AttemptRecord(rid2, 1, "pod-a", datetime.now(timezone.utc), 1.0, "delivered", 200, None, None)
    assert await db.run(claims.settle_delivered, rid2, claimed["lease_token"], "flaky", attempt2) is not None
    [lst] = await fetch(db, "SELECT consecutive_failures, backoff_level FROM listeners WHERE name = 'flaky'")
    assert lst == {"consecutive_failures": 0, "backoff_level": 0}
    [row] = await fetch(db, "SELECT status FROM deliveries WHERE id = $1", rid2)
    assert row["status"] == "delivered"
    assert len(await fetch(db, "SELECT 1 FROM delivery_attempts WHERE delivery_id = $1", rid2)) == 1
