"""Claims and settlement of outbox rows (asyncio side; called through ``Database.run``).

Both claim paths use the one ``claim_rows`` statement: ``claim_due`` as is, ``claim_by_id``
with ``AND d.id = ANY($9)`` added at its marker, so they can never drift apart. Every
settlement (complete, retry, dead-letter) and ``release`` checks the fencing token, so a
late result from an expired lease cannot overwrite a newer claim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from relay_trio import channels
from relay_trio.db import leaves_no_session_state
from relay_trio.queries import Q

_MARKER = "/*by_id*/"
CLAIM_DUE_SQL = Q["claim_rows"].replace(_MARKER, "")
CLAIM_BY_ID_SQL = Q["claim_rows"].replace(_MARKER, "AND d.id = ANY($9::bigint[])")


@dataclass(frozen=True)
class ClaimSpec:
    """Who claims and under which limits (same for both claim paths)."""

    owner: str
    lease_seconds: float
    routes: frozenset[str] | None  # None = every listener
    limit: int
    via: str  # handoff | notify | poll
    budgets: Mapping[str, int]  # remaining in-flight slots of listeners busy in this pod
    default_budget: int  # slots for any other listener


def _claim_args(spec: ClaimSpec) -> list[Any]:
    names = list(spec.budgets)
    return [
        spec.owner,
        float(spec.lease_seconds),
        None if spec.routes is None else sorted(spec.routes),
        int(spec.limit),
        spec.via,
        names,
        [int(spec.budgets[n]) for n in names],
        int(spec.default_budget),
    ]


@leaves_no_session_state
async def claim_due(conn: asyncpg.Connection, spec: ClaimSpec) -> list[asyncpg.Record]:
    if spec.limit <= 0:
        return []
    return await conn.fetch(CLAIM_DUE_SQL, *_claim_args(spec))


@leaves_no_session_state
async def claim_by_id(conn: asyncpg.Connection, spec: ClaimSpec, ids: Sequence[int]) -> list[asyncpg.Record]:
    if spec.limit <= 0 or not ids:
        return []
    return await conn.fetch(CLAIM_BY_ID_SQL, *_claim_args(spec), list(ids))


@dataclass(frozen=True)
class AttemptRecord:
    delivery_id: int
    attempt: int
    pod_id: str
    started_at: datetime
    duration_ms: float
    outcome: str
    status_code: int | None
    error: str | None
    response_body: str | None


async def insert_attempt_tx(conn: asyncpg.Connection, a: AttemptRecord) -> None:
    await conn.execute(
        Q["insert_attempt"], a.delivery_id, a.attempt, a.pod_id, a.started_at, a.duration_ms,
        a.outcome, a.status_code, a.error, a.response_body,
    )


async def settle_delivered_tx(
    conn: asyncpg.Connection, delivery_id: int, token: int, listener: str, attempt: AttemptRecord
) -> float | None:
    """Mark delivered (fencing-checked) and reset the listener's failure streak.

    The slow path of ``settle_delivered``, taken only when the listener has failure state
    to reset. Lock order: the listener before any delivery row (see
    listener_lock_for_settle); the lock's answer says whether a reset is still needed.
    Returns commit-to-delivered seconds, or None when the token was stale.
    """
    reset = bool(await conn.fetchval(Q["listener_lock_for_settle"], listener))
    await insert_attempt_tx(conn, attempt)
    age = await conn.fetchval(Q["complete_delivery"], delivery_id, token)
    if reset:
        await conn.execute(Q["listener_succeeded"], listener)
    return age


@leaves_no_session_state
async def settle_delivered(
    conn: asyncpg.Connection, delivery_id: int, token: int, listener: str, attempt: AttemptRecord
) -> float | None:
    """Mark delivered, the cheap way: run with ``Database.run`` (NOT run_tx).

    Why: a success is the hot path of every delivery, and settle_delivered_tx costs five
    round trips (BEGIN, peek, insert attempt, complete, COMMIT). The ``settle_delivered``
    statement does the same writes atomically in one round trip while the listener is
    clean (the usual case, where settle_delivered_tx takes no listener lock either). When
    the listener needs its failure state reset, that statement changed nothing and the
    locked transaction runs instead, on the same connection and in the same crossing.

    Returns commit-to-delivered seconds, or None when the token was stale.
    """
    row = await conn.fetchrow(
        Q["settle_delivered"], delivery_id, token, listener, attempt.attempt, attempt.pod_id, attempt.started_at,
        attempt.duration_ms, attempt.outcome, attempt.status_code, attempt.error, attempt.response_body,
    )
    if row["listener_clean"]:
        return row["age_seconds"]
    async with conn.transaction():
        return await settle_delivered_tx(conn, delivery_id, token, listener, attempt)


async def settle_failed_tx(
    conn: asyncpg.Connection,
    delivery_id: int,
    token: int,
    listener: str,
    attempt: AttemptRecord,
    *,
    delay: float,
    retention: float,
    failure_threshold: int,
    pause_for_level: Callable[[int], float],
) -> str | None:
    """Record a failed attempt; the row is due again after ``delay`` or dead past retention.

    Also counts the listener's consecutive failure and, at the threshold, pauses the whole
    listener (only when it is not already paused, so concurrent failures of one listener
    raise the level once). Returns the row's new status, or None when the token was stale.
    """
    await conn.fetchval(Q["listener_lock_for_settle"], listener)  # lock order: listener first
    await insert_attempt_tx(conn, attempt)
    status = await conn.fetchval(Q["retry_delivery"], delivery_id, token, delay, retention, attempt.error)
    row = await conn.fetchrow(Q["listener_failed"], listener)
    if row is not None and row["consecutive_failures"] >= failure_threshold and not row["paused"]:
        level = row["backoff_level"] + 1
        await conn.execute(Q["pause_listener"], listener, level, pause_for_level(level))
    return status


async def settle_gone_tx(
    conn: asyncpg.Connection, delivery_id: int, token: int, listener: str, attempt: AttemptRecord
) -> int:
    """HTTP 410: this row is dead, the listener is disabled, its pending rows dead-lettered.

    Returns how many other pending rows were dead-lettered.
    """
    await conn.fetchval(Q["listener_lock_for_settle"], listener)  # lock order: listener first
    await insert_attempt_tx(conn, attempt)
    await conn.fetchval(Q["dead_letter_delivery"], delivery_id, token, "gone", attempt.error)
    await conn.execute(Q["disable_listener"], listener, "endpoint answered 410 Gone")
    result = await conn.execute(Q["dead_letter_listener_rows"], listener, "listener_disabled")
    # Let every pod's registry cache see the change (rare event: NOTIFY in-tx is fine).
    await conn.execute("SELECT pg_notify($1, $2)", channels.REGISTRY, listener)
    return int(result.split()[-1])


async def release_leases(conn: asyncpg.Connection, leases: Sequence[tuple[int, int]]) -> int:
    """Give rows back so any pod can claim them at once (only where the token still matches)."""
    if not leases:
        return 0
    result = await conn.execute(Q["release_leases"], [i for i, _ in leases], [t for _, t in leases])
    return int(result.split()[-1])


# -- admin reads and redelivery ------------------------------------------------------------
async def list_deliveries(
    conn: asyncpg.Connection, *, listener: str | None, status: str | None, before: int | None, limit: int
) -> list[asyncpg.Record]:
    return await conn.fetch(Q["list_deliveries"], listener, status, before, limit)


async def get_delivery(conn: asyncpg.Connection, delivery_id: int) -> tuple[asyncpg.Record | None, list[asyncpg.Record]]:
    row = await conn.fetchrow(Q["get_delivery"], delivery_id)
    if row is None:
        return None, []
    return row, await conn.fetch(Q["get_delivery_attempts"], delivery_id)


async def redeliver(conn: asyncpg.Connection, delivery_id: int) -> tuple[str, asyncpg.Record | None]:
    """('ok', row) | ('not_found', None) | ('pending', None) (already pending: nothing to do)."""
    row = await conn.fetchrow(Q["redeliver_delivery"], delivery_id)
    if row is not None:
        return "ok", row
    status = await conn.fetchval(Q["delivery_status"], delivery_id)
    return ("not_found" if status is None else "pending"), None
