"""Intake's writes: the event, its outbox rows, and in-transaction NOTIFY (asyncio side).

Every function here takes the connection of a transaction the caller opened with
``Database.run_tx`` (``*_tx``), so intake composes them into one transaction and one
trio->asyncio crossing. The event INSERT is the first write of that transaction: its
trigger assigns ``seq`` and ``txid`` together, which pull streams rely on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from relay_trio import channels
from relay_trio.queries import Q


class NotifyPayloadError(ValueError):
    """A NOTIFY channel or payload PostgreSQL would refuse (refused before sending)."""


@dataclass(frozen=True)
class InsertedEvent:
    seq: int
    accepted_at: datetime
    # (listener, delivery_id) for every outbox row written, in id order.
    rows: list[tuple[str, int]]


@dataclass(frozen=True)
class ExistingEvent:
    seq: int
    body_hash: str
    response: dict[str, Any] | None


def check_notify(channel: str, payload: str) -> None:
    """Refuse what pg_notify would refuse, before it aborts the caller's transaction."""
    if not channel or len(channel.encode("utf-8")) > channels.MAX_CHANNEL_BYTES:
        raise NotifyPayloadError(f"NOTIFY channel name must be 1-{channels.MAX_CHANNEL_BYTES} bytes: {channel[:80]!r}")
    size = len(payload.encode("utf-8"))
    if size > channels.MAX_PAYLOAD_BYTES:
        raise NotifyPayloadError(
            f"NOTIFY payload is {size} bytes; PostgreSQL accepts at most {channels.MAX_PAYLOAD_BYTES}"
        )


async def insert_event_tx(
    conn: asyncpg.Connection,
    *,
    event_id: str,
    channel: str,
    author: str,
    content: str,
    mentions: Sequence[str],
    meta_json: str,
    body_hash: str,
) -> InsertedEvent | None:
    """Insert the event and one outbox row per mentioned ENABLED listener, in one statement.

    Returns None when an event with this id already exists (after waiting for a
    concurrent writer of the same id to commit or roll back).
    """
    row = await conn.fetchrow(
        Q["insert_event_with_outbox"], event_id, channel, author, content, list(mentions), meta_json, body_hash
    )
    if row is None:
        return None
    return InsertedEvent(
        seq=row["seq"],
        accepted_at=row["accepted_at"],
        rows=list(zip(row["listeners"], row["delivery_ids"])),
    )


async def enqueue_tx(conn: asyncpg.Connection, event_seq: int, listener_names: Iterable[str]) -> list[tuple[str, int]]:
    """Write outbox rows for an already inserted event: one per name that is an ENABLED
    listener. Returns ``[(listener, delivery_id)]``; the caller computes the unrouted names
    as the mentioned ones missing here. (Intake normally gets this from insert_event_tx's
    single statement; this is the standalone form for other writers and tests.)
    """
    rows = await conn.fetch(
        Q["enqueue_outbox"],
        event_seq,
        list(dict.fromkeys(listener_names)),
    )
    return [(r["listener"], r["id"]) for r in rows]


async def store_response_tx(conn: asyncpg.Connection, seq: int, response: dict[str, Any]) -> None:
    """Keep the original 202 body so a retried POST of the same id replays it exactly."""
    await conn.execute(Q["store_event_response"], seq, json.dumps(response, separators=(",", ":")))


async def get_event_for_replay(conn: asyncpg.Connection, event_id: str) -> ExistingEvent | None:
    row = await conn.fetchrow(Q["get_event_for_replay"], event_id)
    if row is None:
        return None
    response = row["response"]
    return ExistingEvent(
        seq=row["seq"],
        body_hash=row["body_hash"],
        response=json.loads(response) if isinstance(response, str) else response,
    )


async def notify_tx(conn: asyncpg.Connection, channel: str, payload: str) -> None:
    """pg_notify inside the caller's transaction (delivered at its COMMIT).

    Used by RELAY_NOTIFY_MODE=in-tx and by rare registry writes. The notifier uses the
    same statement outside any event transaction.
    """
    check_notify(channel, payload)
    await conn.execute(Q["pg_notify"], channel, payload)
