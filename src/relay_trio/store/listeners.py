"""The listener registry (asyncio side): create/update, read, delete, and the cache load.

Writes send ``pg_notify(relay_registry, name)`` in their own transaction so every pod's
registry cache refreshes within a second (registry writes are rare; the NOTIFY commit
lock does not matter here). The public reads never select the secret.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from relay_trio import channels
from relay_trio.queries import Q
from relay_trio.store.events import notify_tx

LIST_LIMIT = 10_000


@dataclass(frozen=True)
class CachedListener:
    """What the delivery side needs about one enabled listener."""

    name: str
    url: str
    secret: str
    paused_until: datetime | None
    updated_at: datetime


def _public(row: asyncpg.Record) -> dict[str, Any]:
    out = {k: row[k] for k in (
        "name", "url", "enabled", "disabled_reason", "consecutive_failures", "backoff_level", "has_stream_token"
    )}
    for k in ("paused_until", "created_at", "updated_at"):
        out[k] = row[k].isoformat() if row[k] is not None else None
    return out


async def upsert_listener(
    conn: asyncpg.Connection,
    name: str,
    url: str,
    secret: str,
    secret_given: bool,
    enabled: bool | None,
    stream_token_hash: str,
) -> tuple[bool, dict[str, Any]]:
    """Create or update (one statement, race-free). Returns (created, public view).

    ``secret`` and ``stream_token_hash`` are the freshly generated values used only when
    the row is created (and ``secret`` on update only when ``secret_given``).
    """
    async with conn.transaction():
        row = await conn.fetchrow(
            Q["listener_upsert"], name, url, secret, enabled, stream_token_hash, secret_given
        )
        await notify_tx(conn, channels.REGISTRY, name)
    return bool(row["created"]), _public(row)


async def get_listener(conn: asyncpg.Connection, name: str) -> dict[str, Any] | None:
    row = await conn.fetchrow(Q["listener_get_public"], name)
    return _public(row) if row is not None else None


async def list_listeners(conn: asyncpg.Connection, limit: int = LIST_LIMIT) -> list[dict[str, Any]]:
    return [_public(r) for r in await conn.fetch(Q["listener_list_public"], limit)]


async def delete_listener(conn: asyncpg.Connection, name: str) -> int | None:
    """Delete the listener and end its pending deliveries as dead ('listener_deleted').

    Returns how many deliveries were ended, or None when no such listener exists.
    """
    async with conn.transaction():
        deleted = await conn.fetchval(Q["listener_delete"], name)
        if deleted is None:
            return None
        status = await conn.execute(Q["deliveries_dead_for_listener"], name)
        await notify_tx(conn, channels.REGISTRY, name)
    return int(status.split()[-1])


async def load_enabled_listeners(conn: asyncpg.Connection) -> list[CachedListener]:
    rows = await conn.fetch(Q["listeners_enabled_for_cache"])
    return [
        CachedListener(
            name=r["name"], url=r["url"], secret=r["secret"], paused_until=r["paused_until"], updated_at=r["updated_at"]
        )
        for r in rows
    ]
