"""Outcomes on real PostgreSQL through PgDeliveryStore.settle: retry schedule, Retry-After,
410, retention to dead, whole-listener backoff; and the schedule's pure functions."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from delivery_support import add_listener, add_rows, execute, fetch
from relay_trio.config import Settings
from relay_trio.delivery import model
from relay_trio.delivery.pg_store import PgDeliveryStore
from relay_trio.delivery.schedule import clamp_retry_after, listener_pause, parse_retry_after, retry_delay


def settings(**kw) -> Settings:
    return Settings(database_url="postgresql://unused", pod_id="pod-a", **kw)


def result(outcome, status=None, *, retry_after=None, body=None, error=None):
    return model.AttemptResult(outcome, datetime.now(timezone.utc), 12.5, status_code=status,
                               error=error or (f"HTTP {status}" if status else "boom"),
                               response_body=body, retry_after=retry_after)


async def claim_one(store):
    rows = await store.claim_due(10, {}, 10)
    assert len(rows) == 1, rows
    return rows[0]


async def due_in(db, rid) -> float:
    [r] = await fetch(db, "SELECT EXTRACT(EPOCH FROM due_at - clock_timestamp())::float8 AS s FROM deliveries WHERE id=$1", rid)
    return r["s"]


# -- pure schedule -----------------------------------------------------------------------------
def test_retry_delay_doubles_with_jitter_and_is_capped():
    for attempt, nominal in [(1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0)]:
        lo = retry_delay(attempt, base=1.0, cap=300.0, rand=lambda: 0.0)
        hi = retry_delay(attempt, base=1.0, cap=300.0, rand=lambda: 0.999999)
        assert lo == pytest.approx(nominal * 0.8) and hi == pytest.approx(nominal * 1.2, rel=1e-5)
    rng = random.Random(1)
    samples = {round(retry_delay(1, base=1.0, cap=300.0, rand=rng.random), 3) for _ in range(50)}
    assert len(samples) > 10  # jitter spreads retries
    assert retry_delay(40, base=1.0, cap=300.0) <= 300.0
    assert retry_delay(1000, base=1.0, cap=300.0, rand=lambda: 0.0) == pytest.approx(240.0)


def test_retry_after_parsing_and_clamping():
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after("Thu, 01 Jan 2026 00:00:30 GMT", now=now) == 30.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    # hostile values: a latin-1 superscript digit ("\xb2" on the wire) is not a number,
    # and absurd dates or numbers never raise
    assert parse_retry_after("\u00b2") is None
    assert parse_retry_after("\u0661\u0662") is None  # Arabic-Indic digits
    assert parse_retry_after("9" * 400) is not None
    assert parse_retry_after("Thu, 01 Jan 99999 00:00:30 GMT") is None
    assert clamp_retry_after(0.0, base=1.0, cap=300.0) == 1.0
    assert clamp_retry_after(86400.0, base=1.0, cap=300.0) == 300.0
    assert clamp_retry_after(42.0, base=1.0, cap=300.0) == 42.0


def test_listener_pause_doubles_to_its_cap():
    assert [listener_pause(n, base=5.0, cap=600.0) for n in (1, 2, 3, 8, 50)] == [5, 10, 20, 600, 600]


# -- settle on PostgreSQL -----------------------------------------------------------------------
async def test_failure_is_recorded_and_retried_with_backoff(db):
    await add_listener(db, "bot")
    [rid] = await add_rows(db, ["bot"])
    store = PgDeliveryStore(db, settings(), "pod-a")
    row = await claim_one(store)
    settled = await store.settle(row, result(model.HTTP_ERROR, 500, body="x" * 1024))
    assert settled.result == "retried"
    [d] = await fetch(db, "SELECT status, lease_owner, lease_token, attempts, last_error FROM deliveries WHERE id=$1", rid)
    assert d == {"status": "pending", "lease_owner": None, "lease_token": None, "attempts": 1, "last_error": "HTTP 500"}
    assert 0.7 <= await due_in(db, rid) <= 1.3  # first retry about 1 s
    [a] = await fetch(db, "SELECT attempt, pod_id, outcome, status_code, duration_ms, length(response_body) AS n FROM delivery_attempts")
    assert a == {"attempt": 1, "pod_id": "pod-a", "outcome": "http_error", "status_code": 500, "duration_ms": 12.5, "n": 1024}
    # Not claimable before its due time.
    assert await store.claim_due(10, {}, 10) == []
    await execute(db, "UPDATE deliveries SET due_at = now() WHERE id=$1", rid)
    row2 = await claim_one(store)
    assert row2.attempt == 2
    await store.settle(row2, result(model.TIMEOUT))
    assert 1.5 <= await due_in(db, rid) <= 2.5  # then about 2 s
    [ls] = await fetch(db, "SELECT consecutive_failures FROM listeners WHERE name='bot'")
    assert ls["consecutive_failures"] == 2


async def test_retry_after_is_honoured_within_bounds(db):
    await add_listener(db, "bot")
    [rid] = await add_rows(db, ["bot"])
    store = PgDeliveryStore(db, settings(), "pod-a")
    await store.settle(await claim_one(store), result(model.THROTTLED, 429, retry_after=120.0))
    assert 119 <= await due_in(db, rid) <= 120.5
    await execute(db, "UPDATE deliveries SET due_at = now() WHERE id=$1", rid)
    await store.settle(await claim_one(store), result(model.THROTTLED, 503, retry_after=86400.0))
    assert 299 <= await due_in(db, rid) <= 300.5  # clamped to the cap
    await execute(db, "UPDATE deliveries SET due_at = now() WHERE id=$1", rid)
    await store.settle(await claim_one(store), result(model.THROTTLED, 429, retry_after=0.0))
    assert 0.9 <= await due_in(db, rid) <= 1.1  # never sooner than the base


async def test_gone_disables_the_listener_and_dead_letters_its_rows(db):
    await add_listener(db, "bot")
    await add_listener(db, "other")
    ids = await add_rows(db, ["bot", "bot", "bot", "other"])
    store = PgDeliveryStore(db, settings(), "pod-a")
    rows = await store.claim_due(1, {}, 10)
    settled = await store.settle(rows[0], result(model.GONE, 410))
    assert settled.result == "dead"
    got = {r["id"]: (r["status"], r["dead_reason"]) for r in await fetch(db, "SELECT id, status, dead_reason FROM deliveries")}
    assert got == {ids[0]: ("dead", "gone"), ids[1]: ("dead", "listener_disabled"),
                   ids[2]: ("dead", "listener_disabled"), ids[3]: ("pending", None)}
    [ls] = await fetch(db, "SELECT enabled, disabled_reason FROM listeners WHERE name='bot'")
    assert ls["enabled"] is False and "410" in ls["disabled_reason"]
    # A row written later for the disabled listener is not claimable.
    await add_rows(db, ["bot"])
    assert [r.listener for r in await store.claim_due(10, {}, 10)] == ["other"]


async def test_row_older_than_retention_becomes_dead_after_a_failed_attempt(db):
    await add_listener(db, "bot")
    [old, young] = await add_rows(db, ["bot", "bot"])
    await execute(db, "UPDATE deliveries SET created_at = now() - interval '16 minutes' WHERE id=$1", old)
    store = PgDeliveryStore(db, settings(), "pod-a")
    for row in await store.claim_due(10, {}, 10):
        settled = await store.settle(row, result(model.CONNECT_ERROR, error="ConnectError: refused"))
        assert settled.result == ("dead" if row.id == old else "retried")
    got = {r["id"]: (r["status"], r["dead_reason"]) for r in await fetch(db, "SELECT id, status, dead_reason FROM deliveries")}
    assert got == {old: ("dead", "retention"), young: ("pending", None)}


async def test_listener_backed_off_after_threshold_and_reset_by_one_success(db):
    await add_listener(db, "bot")
    await add_rows(db, ["bot"] * 4)
    store = PgDeliveryStore(db, settings(listener_failure_threshold=3, listener_backoff_base=60.0), "pod-a")
    rows = await store.claim_due(10, {}, 10)
    for row in rows[:3]:
        await store.settle(row, result(model.HTTP_ERROR, 500))
    [ls] = await fetch(db, "SELECT consecutive_failures, backoff_level, EXTRACT(EPOCH FROM paused_until - now())::float8 AS p FROM listeners")
    assert ls["consecutive_failures"] == 3 and ls["backoff_level"] == 1 and 55 <= ls["p"] <= 61
    await execute(db, "UPDATE deliveries SET due_at = now() WHERE status = 'pending'")
    await store.settle(rows[3], result(model.HTTP_ERROR, 500))  # concurrent failure: no second doubling
    [ls] = await fetch(db, "SELECT backoff_level FROM listeners")
    assert ls["backoff_level"] == 1
    await execute(db, "UPDATE deliveries SET due_at = now() WHERE status = 'pending'")
    assert await store.claim_due(10, {}, 10) == []  # paused: nothing claimable
    # The probe after the pause fails: the pause doubles.
    await execute(db, "UPDATE listeners SET paused_until = now() - interval '1 second'")
    probe = (await store.claim_due(1, {}, 10))[0]
    await store.settle(probe, result(model.HTTP_ERROR, 500))
    [ls] = await fetch(db, "SELECT backoff_level, EXTRACT(EPOCH FROM paused_until - now())::float8 AS p FROM listeners")
    assert ls["backoff_level"] == 2 and 115 <= ls["p"] <= 121
    # One success resets everything.
    await execute(db, "UPDATE listeners SET paused_until = now() - interval '1 second'")
    await execute(db, "UPDATE deliveries SET due_at = now() WHERE status = 'pending'")
    ok = (await store.claim_due(1, {}, 10))[0]
    assert (await store.settle(ok, result(model.DELIVERED, 200))).result == "delivered"
    [ls] = await fetch(db, "SELECT consecutive_failures, backoff_level, paused_until FROM listeners")
    assert ls == {"consecutive_failures": 0, "backoff_level": 0, "paused_until": None}


async def test_nul_bytes_in_a_response_body_or_error_still_settle(db):
    await add_listener(db, "bot")
    [rid] = await add_rows(db, ["bot"])
    store = PgDeliveryStore(db, settings(), "pod-a")
    settled = await store.settle(await claim_one(store), result(model.HTTP_ERROR, 500, body="a\x00b", error="e\x00"))
    assert settled.result == "retried"
    [a] = await fetch(db, "SELECT response_body, error FROM delivery_attempts WHERE delivery_id=$1", rid)
    assert a == {"response_body": "a\ufffdb", "error": "e\ufffd"}


def test_the_lease_outlives_one_attempt_and_its_settle():
    from relay_trio.config import Settings
    from relay_trio.delivery.pg_store import min_lease

    short = Settings(lease_seconds=3.0, delivery_timeout=2.0, pool_acquire_timeout=0.5, db_timeout=1.5)
    assert min_lease(short) == 5.0  # 2 + 0.5 + 1.5 + 1: a slow settle cannot lose the lease
    assert min_lease(Settings(lease_seconds=60.0)) == 60.0
