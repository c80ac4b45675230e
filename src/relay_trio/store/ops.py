"""Operations queries (asyncio side): listener lag for the gauges, and the shutdown
safety net that releases a pod's leases and wakes the other pods."""

from __future__ import annotations

import asyncpg

from relay_trio import channels
from relay_trio.queries import Q


async def oldest_pending_by_listener(conn: asyncpg.Connection) -> dict[str, float]:
    """Registered listener name -> age in seconds of its oldest pending row (0 if none)."""
    rows = await conn.fetch(Q["ops_oldest_pending_by_listener"])
    return {r["listener"]: max(r["age_seconds"] or 0.0, 0.0) for r in rows}


def wake_payload(listeners: list[str]) -> str:
    """Comma-separated distinct names, cut to fit a NOTIFY payload (it is only a hint)."""
    out: list[str] = []
    size = 0
    for name in sorted(set(listeners)):
        extra = len(name.encode()) + (1 if out else 0)
        if size + extra > channels.MAX_PAYLOAD_BYTES:
            break
        out.append(name)
        size += extra
    return ",".join(out)


async def release_pod_leases(conn: asyncpg.Connection, pod_id: str, wake: bool = True) -> int:
    """Release every lease ``pod_id`` holds (call inside ``run_tx``), then wake the other
    pods with one NOTIFY on the outbox channel, so they claim now, not at their next poll,
    both these rows and the ones the delivery loop released or never claimed (hand-offs
    left in the channel). An empty payload means "any listener". The NOTIFY commits with
    the release: a pod woken by it always sees the rows free."""
    rows = await conn.fetch(Q["ops_release_pod_leases"], pod_id)
    if rows or wake:
        payload = "" if wake else wake_payload([r["listener"] for r in rows])
        await conn.execute("SELECT pg_notify($1, $2)", channels.OUTBOX, payload)
    return len(rows)
