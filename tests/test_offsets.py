"""Saved offsets and cursor reads of a listener's stream, on a real PostgreSQL."""

from __future__ import annotations

import pytest
import trio

from relay_trio.db import connect_dedicated, on_connection
from relay_trio.store.offsets import OffsetRegression, read_offset, read_stream, save_offset_tx


class Boom(Exception):
    pass


async def insert_event(conn, event_id: str, mentions: list[str]) -> int:
    return await conn.fetchval(
        "INSERT INTO events (id, channel, author, content, mentions, body_hash)"
        " VALUES ($1, 'general', 'tester', 'hello ' || $1, $2, 'h') RETURNING seq",
        event_id,
        mentions,
    )


async def test_offset_saved_in_the_callers_transaction(db):
    assert await db.run(read_offset, "alpha") is None
    assert await db.run_tx(save_offset_tx, "alpha", 5) == 5
    assert await db.run(read_offset, "alpha") == 5

    async def save_then_fail(conn):
        await save_offset_tx(conn, "alpha", 9)
        assert await read_offset(conn, "alpha") == 9  # visible inside the transaction
        raise Boom

    with pytest.raises(Boom):
        await db.run_tx(save_then_fail)
    assert await db.run(read_offset, "alpha") == 5  # the rollback left the old offset


async def test_offset_is_monotonic(db):
    await db.run_tx(save_offset_tx, "alpha", 7)
    assert await db.run_tx(save_offset_tx, "alpha", 7) == 7  # same value: idempotent
    with pytest.raises(OffsetRegression) as info:
        await db.run_tx(save_offset_tx, "alpha", 6)
    assert info.value.current == 7
    assert await db.run(read_offset, "alpha") == 7
    assert await db.run_tx(save_offset_tx, "alpha", 8) == 8
    # Offsets are per listener.
    assert await db.run_tx(save_offset_tx, "beta", 1) == 1


async def test_stream_reads_mentions_in_seq_order_after_cursor(db):
    async def seed(conn):
        return [
            await insert_event(conn, "e1", ["alpha"]),
            await insert_event(conn, "e2", ["beta"]),
            await insert_event(conn, "e3", ["alpha", "beta"]),
            await insert_event(conn, "e4", ["alpha"]),
        ]

    s1, _s2, s3, s4 = await db.run(seed)
    events = await db.run(read_stream, "alpha", 0)
    assert [e.seq for e in events] == [s1, s3, s4]
    assert [e.id for e in events] == ["e1", "e3", "e4"]
    assert [e.seq for e in await db.run(read_stream, "alpha", s1)] == [s3, s4]
    assert [e.seq for e in await db.run(read_stream, "alpha", 0, 2)] == [s1, s3]
    assert await db.run(read_stream, "alpha", s4) == []
    assert events[0].as_json()["content"] == "hello e1"


async def test_lower_seq_committing_last_is_not_skipped(db):
    """Two concurrent writers; the lower seq commits after the higher one.

    A reader must not return the higher seq while the lower one is still in flight:
    its cursor would move past the lower seq and skip it forever.
    """
    first = await connect_dedicated(db.dsn, "test-writer-1")
    second = await connect_dedicated(db.dsn, "test-writer-2")
    try:

        async def begin_and_insert(conn, event_id):
            await conn.execute("BEGIN")
            return await insert_event(conn, event_id, ["alpha"])

        async def commit(conn):
            await conn.execute("COMMIT")

        low = await on_connection(first, begin_and_insert, "low")
        high = await on_connection(second, begin_and_insert, "high")
        assert low < high
        await on_connection(second, commit)

        # The higher seq is committed but the lower one is still running: read nothing.
        assert await db.run(read_stream, "alpha", 0) == []

        await on_connection(first, commit)
        cursor = 0
        seen = []
        for event in await db.run(read_stream, "alpha", cursor):
            seen.append(event.seq)
            cursor = event.seq
        assert seen == [low, high]
    finally:
        with trio.CancelScope(shield=True):
            for conn in (first, second):
                await on_connection(conn, lambda c: c.close())
