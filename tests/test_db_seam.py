"""The trio/asyncio seam (relay_trio.db): timers, deadlines, error translation."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest
import trio

from relay_trio.db import (
    Database,
    DatabaseTimeout,
    DatabaseUnavailable,
    PoolExhausted,
    open_asyncio_loop,
    timer_heap,
)


async def select_one(conn: asyncpg.Connection) -> int:
    return await conn.fetchval("SELECT 1")


async def select_one_with_asyncio_timeout(conn: asyncpg.Connection) -> int:
    # What asyncpg does internally for every query with timeout=: an asyncio timer that
    # is cancelled when the query finishes. Under trio-asyncio 0.16 each one stays in the
    # heap until its deadline (here 300 s) unless something compacts the heap.
    return await asyncio.wait_for(conn.fetchval("SELECT 1"), 300)


async def test_pool_releases_schedule_no_timers(database_url):
    """max_inactive_connection_lifetime=0: thousands of acquire/release leave no timers.

    The compactor is effectively off here, so this pins the pool setting on its own.
    """
    async with open_asyncio_loop(compact_interval=3600) as loop:
        db = await Database.connect(database_url, min_size=1, max_size=2)
        try:
            for _ in range(2000):
                assert await db.run(select_one) == 1
            assert len(timer_heap(loop)) < 50, f"timer heap grew to {len(timer_heap(loop))}"
        finally:
            await db.close()


async def test_compactor_bounds_the_timer_heap(database_url):
    """Cancelled asyncio timers (per-query timeouts) do not accumulate."""
    async with open_asyncio_loop(compact_interval=0.05) as loop:
        db = await Database.connect(database_url, min_size=1, max_size=2)
        try:
            for _ in range(3000):
                assert await db.run(select_one_with_asyncio_timeout) == 1
            await trio.sleep(0.2)
            heap = timer_heap(loop)
            assert len(heap) < 100, f"timer heap holds {len(heap)} timers after 3000 operations"
        finally:
            await db.close()


async def test_run_tx_rolls_back_when_the_operation_raises(db):
    async def create(conn):
        await conn.execute("CREATE TABLE seam_probe (x int)")

    await db.run(create)

    class Boom(Exception):
        pass

    async def insert_then_fail(conn):
        await conn.execute("INSERT INTO seam_probe VALUES (1)")
        raise Boom

    with pytest.raises(Boom):
        await db.run_tx(insert_then_fail)

    async def count(conn):
        return await conn.fetchval("SELECT count(*) FROM seam_probe")

    assert await db.run(count) == 0


async def test_killed_backend_becomes_database_unavailable_and_pool_recovers(db):
    async def kill_myself(conn):
        await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    with pytest.raises(DatabaseUnavailable):
        await db.run(kill_myself)
    # the pool replaces the dead connection
    for _ in range(3):
        assert await db.run(select_one) == 1


async def test_trio_deadline_cancels_a_slow_query_and_the_pool_stays_usable(db):
    async def slow(conn):
        await conn.execute("SELECT pg_sleep(10)")

    with trio.fail_after(5):
        with pytest.raises(DatabaseTimeout):
            await db.run(slow, timeout=0.2)
    assert await db.run(select_one) == 1


async def test_saturated_pool_answers_pool_exhausted_quickly(aio_loop, database_url):
    db = await Database.connect(database_url, min_size=1, max_size=1, acquire_timeout=0.2)
    try:
        holding = trio.Event()

        async def hold(conn):
            holding.set()
            await conn.execute("SELECT pg_sleep(1.5)")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(db.run, hold)
            await holding.wait()
            start = trio.current_time()
            with pytest.raises(PoolExhausted):
                await db.run(select_one)
            assert trio.current_time() - start < 1.0
    finally:
        await db.close()


async def test_unreachable_server_is_database_unavailable(aio_loop, tmp_path):
    dsn = f"postgresql://nobody@/postgres?host={tmp_path}&port=1"
    with pytest.raises(DatabaseUnavailable):
        await Database.connect(dsn, min_size=1, max_size=1)


async def test_a_raising_asyncio_callback_is_logged_not_fatal(aio_loop, caplog):
    def explode():
        raise RuntimeError("callback failure")

    with caplog.at_level(logging.ERROR, logger="relay_trio.db"):
        aio_loop.call_soon(explode)
        await trio.sleep(0.05)
        # the loop still runs asyncio work afterwards
        fut = aio_loop.create_future()
        aio_loop.call_soon(fut.set_result, 42)
        from trio_asyncio import aio_as_trio

        assert await aio_as_trio(lambda: fut)() == 42
    assert any("callback failure" in (r.exc_text or "") or "callback" in r.getMessage() for r in caplog.records)


async def test_a_frozen_pooled_backend_cannot_hang_an_operation(aio_loop, database_url):
    """A deadline holds even when the server never answers the cancel (SIGSTOPped backend):
    the watchdog terminates the connection and the pool recovers."""
    import os
    import signal

    db = await Database.connect(database_url, min_size=1, max_size=1, acquire_timeout=1.0)
    try:

        async def backend_pid(conn):
            return await conn.fetchval("SELECT pg_backend_pid()")

        pid = await db.run(backend_pid)
        try:
            os.kill(pid, signal.SIGSTOP)
        except (PermissionError, ProcessLookupError):
            pytest.skip("cannot signal the server's backends (external server)")
        try:
            start = trio.current_time()
            with trio.fail_after(10):
                with pytest.raises(DatabaseTimeout):
                    await db.run_tx(select_one, timeout=1.0)
            assert trio.current_time() - start < 5.0
            assert db.terminated_by_watchdog == 1
        finally:
            os.kill(pid, signal.SIGCONT)
        with trio.fail_after(10):
            assert await db.run(select_one) == 1
    finally:
        await db.close()


async def test_release_skips_the_reset_only_after_a_clean_operation(aio_loop, database_url):
    """The pool's reset query (advisory unlock, CLOSE ALL, UNLISTEN, RESET ALL) is skipped
    on release only after an operation marked @leaves_no_session_state that returned
    normally: session state a failure left behind (here an advisory lock, as the event
    trigger could after a cancel) is cleared; a marked clean operation costs no extra round
    trip (a query logger sees none); an unmarked one still gets the reset."""
    from relay_trio.db import leaves_no_session_state

    @leaves_no_session_state
    async def marked_select_one(conn):
        return await conn.fetchval("SELECT 1")

    db = await Database.connect(database_url, min_size=1, max_size=1)
    try:
        seen: list[str] = []

        async def log_queries(conn):
            conn.add_query_logger(lambda record: seen.append(record.query))

        async def lock_then_fail(conn):
            await conn.execute("SELECT pg_advisory_lock(4242)")
            raise RuntimeError("boom")

        async def lock_then_sleep(conn):
            await conn.execute("SELECT pg_advisory_lock(4243)")
            await conn.execute("SELECT pg_sleep(10)")

        async def lock_free(conn, key):
            return await conn.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = $1", key)

        with pytest.raises(RuntimeError):
            await db.run(lock_then_fail)
        with trio.fail_after(5), pytest.raises(DatabaseTimeout):
            await db.run(lock_then_sleep, timeout=0.3)
        assert await db.run(lock_free, 4242) == 0
        assert await db.run(lock_free, 4243) == 0

        await db.run(log_queries)  # the logger stays on the pool's only connection
        seen.clear()
        for _ in range(3):
            assert await db.run(marked_select_one) == 1
            assert await db.run_tx(marked_select_one) == 1
        assert not [q for q in seen if "pg_advisory_unlock_all" in q], seen
        assert await db.run(select_one) == 1  # not marked: the full reset
        assert len([q for q in seen if "pg_advisory_unlock_all" in q]) == 1
        seen.clear()
        with pytest.raises(RuntimeError):
            await db.run(lock_then_fail)
        assert [q for q in seen if "pg_advisory_unlock_all" in q]
        assert await db.run(lock_free, 4242) == 0
    finally:
        await db.close()
