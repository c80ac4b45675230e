"""The janitor's data operations: one bounded batch per call (relay_trio.janitor loops).

Batches keep each transaction short: a sweep over millions of old rows never holds a
long transaction (which would also hold back every pull stream, see store.offsets).
"""

from __future__ import annotations

import asyncpg

from relay_trio.queries import Q


async def dead_letter_expired(conn: asyncpg.Connection, retention: float, limit: int) -> int:
    """Mark up to ``limit`` unleased pending rows older than ``retention`` s dead ('retention')."""
    rows = await conn.fetch(Q["janitor_dead_letter_expired"], float(retention), limit)
    return len(rows)


async def prune_delivered_tx(conn: asyncpg.Connection, retention: float, limit: int) -> tuple[int, int]:
    """Delete up to ``limit`` delivered rows older than ``retention`` s and their attempts.

    Needs a transaction (``Database.run_tx``): the rows stay locked from the select to the
    deletes. Returns (deliveries deleted, attempts deleted).
    """
    ids = [r["id"] for r in await conn.fetch(Q["janitor_lock_old_delivered"], float(retention), limit)]
    if not ids:
        return 0, 0
    attempts = await conn.execute(Q["janitor_delete_attempts"], ids)
    deliveries = await conn.execute(Q["janitor_delete_deliveries"], ids)
    return _count(deliveries), _count(attempts)


def _count(status: str) -> int:
    """Row count from a command tag such as 'DELETE 42'."""
    return int(status.rsplit(" ", 1)[-1])
