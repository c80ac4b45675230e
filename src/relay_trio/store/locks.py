"""Leased locks: work that must run on exactly one pod at a time (the janitor, say).

A lease is (owner, fencing token, expiry). Expiry is computed by the database clock
(``now()``), so pods with skewed clocks still agree on who holds a lock. Tokens come from
the ``fencing_tokens`` sequence and change on every acquisition: a pod that lost its lease
(it paused past the expiry and someone else took the lock) cannot renew or release the
new holder's lease with its stale token.

Asyncio-side functions, called from trio as ``await db.run(acquire_lock, name, ttl, owner)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from relay_trio.queries import Q


@dataclass(frozen=True)
class Lease:
    name: str
    owner: str
    token: int
    expires_at: datetime


def _lease(row: asyncpg.Record | None) -> Lease | None:
    if row is None:
        return None
    return Lease(name=row["name"], owner=row["owner"], token=row["token"], expires_at=row["expires_at"])


async def acquire_lock(conn: asyncpg.Connection, name: str, ttl: float, owner: str) -> Lease | None:
    """Take ``name`` for ``ttl`` seconds if it is free or expired; None when someone holds it."""
    return _lease(await conn.fetchrow(Q["lock_acquire"], name, owner, float(ttl)))


async def renew_lock(conn: asyncpg.Connection, lease: Lease, ttl: float) -> Lease | None:
    """Extend a live lease by ``ttl`` seconds from now; None when it is no longer ours."""
    return _lease(await conn.fetchrow(Q["lock_renew"], lease.name, lease.owner, lease.token, float(ttl)))


async def release_lock(conn: asyncpg.Connection, lease: Lease) -> bool:
    """Free the lock if this lease still holds it; False when it had already been lost."""
    return await conn.fetchval(Q["lock_release"], lease.name, lease.owner, lease.token) is not None
