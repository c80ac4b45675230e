"""The janitor on a real PostgreSQL: retention sweeps, batches, and one sweeper at a time."""

from __future__ import annotations

import trio

from relay_trio.janitor import LOCK_NAME, Janitor
from relay_trio.runtime import Pod
from relay_trio.store.locks import acquire_lock, release_lock

HOUR = 3600.0


def make_pod(db, settings_factory, **overrides) -> Pod:
    base = dict(delivery_retention=HOUR, delivered_retention=7 * 24 * HOUR, pod_id="janitor-test")
    base.update(overrides)
    return Pod.create(settings_factory(**base), db)


async def seed_event(db) -> int:
    return await db.run(
        lambda conn: conn.fetchval(
            "INSERT INTO events (id, channel, author, content, mentions, body_hash)"
            " VALUES ('e1', 'general', 'tester', 'hi', '{ghost}', 'h') RETURNING seq"
        )
    )


async def add_delivery(db, seq: int, *, status="pending", age="0 seconds", lease=None,
                       delivered_age=None, attempts=0) -> int:
    """A deliveries row created ``age`` ago; ``lease`` is an interval from now (may be negative)."""

    async def op(conn):
        row_id = await conn.fetchval(
            """
            INSERT INTO deliveries (event_seq, listener, status, created_at, due_at,
                                    lease_owner, lease_until, lease_token, delivered_at, dead_reason)
            VALUES ($1, 'ghost', $2, now() - $3::text::interval, now() - $3::text::interval,
                    CASE WHEN $4::text::interval IS NULL THEN NULL ELSE 'some-pod' END,
                    now() + $4::text::interval,
                    CASE WHEN $4::text::interval IS NULL THEN NULL ELSE 1 END,
                    now() - $5::text::interval,
                    CASE WHEN $2 = 'dead' THEN 'gave_up' END)
            RETURNING id
            """,
            seq, status, age, lease, delivered_age,
        )
        for n in range(attempts):
            await conn.execute(
                "INSERT INTO delivery_attempts (delivery_id, attempt, pod_id, started_at, duration_ms, outcome)"
                " VALUES ($1, $2, 'p', now(), 1.0, 'ok')",
                row_id, n + 1,
            )
        return row_id

    return await db.run_tx(op)


async def statuses(db) -> dict[int, tuple[str, str | None]]:
    rows = await db.run(lambda conn: conn.fetch("SELECT id, status, dead_reason FROM deliveries"))
    return {r["id"]: (r["status"], r["dead_reason"]) for r in rows}


async def attempts_of(db) -> dict[int, int]:
    rows = await db.run(
        lambda conn: conn.fetch("SELECT delivery_id, count(*) AS n FROM delivery_attempts GROUP BY delivery_id")
    )
    return {r["delivery_id"]: r["n"] for r in rows}


async def test_sweep_dead_letters_expired_and_prunes_old_delivered(db, settings_factory):
    pod = make_pod(db, settings_factory)
    seq = await seed_event(db)
    expired = await add_delivery(db, seq, age="2 hours")
    expired_lease = await add_delivery(db, seq, age="2 hours", lease="-1 minute")
    leased = await add_delivery(db, seq, age="2 hours", lease="1 hour")
    fresh = await add_delivery(db, seq, age="10 minutes")
    old_dead = await add_delivery(db, seq, status="dead", age="30 days")
    old_delivered = await add_delivery(db, seq, status="delivered", age="9 days", delivered_age="8 days", attempts=2)
    new_delivered = await add_delivery(db, seq, status="delivered", age="2 days", delivered_age="1 day", attempts=1)

    result = await Janitor(pod).run_once()
    assert result is not None and result.complete
    assert (result.dead_lettered, result.pruned_deliveries, result.pruned_attempts) == (2, 1, 2)

    rows = await statuses(db)
    assert rows[expired] == ("dead", "retention")
    assert rows[expired_lease] == ("dead", "retention")
    assert rows[leased] == ("pending", None)  # a live lease: its delivery settles it
    assert rows[fresh] == ("pending", None)
    assert rows[old_dead] == ("dead", "gave_up")
    assert old_delivered not in rows
    assert rows[new_delivered] == ("delivered", None)
    assert await attempts_of(db) == {new_delivered: 1}

    m = pod.metrics
    assert m.janitor_sweeps._value.get() == 1
    assert m.janitor_rows.labels(action="dead_lettered")._value.get() == 2
    assert m.janitor_rows.labels(action="pruned_deliveries")._value.get() == 1
    assert m.janitor_rows.labels(action="pruned_attempts")._value.get() == 2
    # The lock was released at the end of the sweep.
    assert await db.run(acquire_lock, LOCK_NAME, 5.0, "someone-else") is not None


async def test_sweep_works_through_several_batches(db, settings_factory):
    pod = make_pod(db, settings_factory)
    seq = await seed_event(db)
    for _ in range(7):
        await add_delivery(db, seq, age="2 hours")
        await add_delivery(db, seq, status="delivered", age="9 days", delivered_age="8 days", attempts=1)
    janitor = Janitor(pod, batch=3)
    result = await janitor.run_once()
    assert (result.dead_lettered, result.pruned_deliveries, result.pruned_attempts) == (7, 7, 7)
    assert set((await statuses(db)).values()) == {("dead", "retention")}


async def test_no_sweep_while_another_pod_holds_the_lock(db, settings_factory):
    pod = make_pod(db, settings_factory)
    seq = await seed_event(db)
    row = await add_delivery(db, seq, age="2 hours")
    other = await db.run(acquire_lock, LOCK_NAME, 30.0, "other-pod")
    janitor = Janitor(pod)
    assert await janitor.run_once() is None
    assert (await statuses(db))[row] == ("pending", None)
    assert pod.metrics.janitor_sweeps._value.get() == 0
    await db.run(release_lock, other)
    assert (await janitor.run_once()).dead_lettered == 1
    assert (await statuses(db))[row] == ("dead", "retention")


async def test_sweep_stops_when_the_lease_is_lost(db, settings_factory):
    pod = make_pod(db, settings_factory)
    seq = await seed_event(db)
    old_delivered = await add_delivery(db, seq, status="delivered", age="9 days", delivered_age="8 days")
    janitor = Janitor(pod)

    async def steal() -> None:
        # Our lease "expires" and another pod takes the lock, mid-sweep.
        await db.run(lambda conn: conn.execute("UPDATE locks SET expires_at = now() - interval '1 second'"))
        assert await db.run(acquire_lock, LOCK_NAME, 30.0, "thief") is not None

    janitor.on_sweep = steal
    result = await janitor.run_once()
    assert result is not None and not result.complete
    assert old_delivered in await statuses(db)  # pruning never ran without the lock
    owner = await db.run(lambda conn: conn.fetchval("SELECT owner FROM locks WHERE name = $1", LOCK_NAME))
    assert owner == "thief"  # and we did not release the thief's lock


async def test_two_pods_never_sweep_at_the_same_time(pod_factory):
    settings = dict(janitor_interval=0.02, routes="nobody")
    pods = [await pod_factory(**settings), await pod_factory(**settings)]
    for pod in pods:
        assert pod.janitor is not None

        async def slow(pod=pod) -> None:
            await trio.sleep(0.1)  # a long sweep: the other pod's attempts land inside it

        pod.janitor.on_sweep = slow
    with trio.fail_after(30):
        while sum(1 for p in pods for (s, e) in p.janitor.history if e - s >= 0.1) < 6:
            await trio.sleep(0.05)
    spans = sorted((s, e, i) for i, p in enumerate(pods) for (s, e) in p.janitor.history)
    for (s1, e1, i1), (s2, e2, i2) in zip(spans, spans[1:]):
        assert s2 >= e1, f"pod {i1} swept {s1:.3f}..{e1:.3f} while pod {i2} started at {s2:.3f}"
    assert sum(p.janitor.skipped for p in pods) > 0  # they did contend


async def test_rows_past_retention_end_dead_in_a_running_pod(pod_factory, db):
    pod = await pod_factory(janitor_interval=0.05, delivery_retention=HOUR, routes="nobody")
    seq = await seed_event(db)
    row = await add_delivery(db, seq, age="2 hours")
    with trio.fail_after(20):
        while (await statuses(db))[row] != ("dead", "retention"):
            await trio.sleep(0.05)
        # the sweep records its metrics after its batch commits: wait for that too
        while pod.metrics.janitor_rows.labels(action="dead_lettered")._value.get() < 1:
            await trio.sleep(0.05)
