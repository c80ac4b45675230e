"""Pull streams: the events that mention a listener, read by cursor, and saved offsets.

A stream is ``events WHERE listener = ANY(mentions) ORDER BY seq``. Readers only see rows
whose transaction is older than the oldest transaction still running (see
``stream_read`` in sql/queries/streams.sql and the comment at the top of 0001_init.sql):
a cursor may then move past ``seq`` N safely, because no transaction can still commit an
event with a lower seq. The price: one long-running transaction anywhere in the cluster
holds streams back (never loses events).

Offsets are per listener and monotonic. ``save_offset_tx`` takes the caller's transaction
so a consumer's offset can commit together with its own writes (or roll back with them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from relay_trio.queries import Q

STREAM_BATCH = 100


class OffsetRegression(Exception):
    """The consumer tried to move its saved offset backwards."""

    def __init__(self, listener: str, requested: int, current: int):
        super().__init__(f"offset of {listener!r} is {current}; refusing to move it back to {requested}")
        self.listener = listener
        self.requested = requested
        self.current = current


@dataclass(frozen=True)
class StreamEvent:
    seq: int
    id: str
    channel: str
    author: str
    content: str
    mentions: list[str]
    meta: Any
    accepted_at: datetime

    def as_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "id": self.id,
            "channel": self.channel,
            "author": self.author,
            "content": self.content,
            "mentions": self.mentions,
            "meta": self.meta,
            "accepted_at": self.accepted_at.isoformat(),
        }


@dataclass(frozen=True)
class StreamListener:
    name: str
    stream_token_hash: str | None


async def save_offset_tx(conn: asyncpg.Connection, listener: str, seq: int) -> int:
    """Save ``seq`` as the listener's offset inside the caller's transaction.

    Raises ``OffsetRegression`` when ``seq`` is lower than the saved offset.
    """
    saved = await conn.fetchval(Q["offset_save"], listener, seq)
    if saved is None:
        current = await conn.fetchval(Q["offset_read"], listener)
        raise OffsetRegression(listener, seq, current)
    return saved


async def read_offset(conn: asyncpg.Connection, listener: str) -> int | None:
    """The listener's saved offset, or None when it never saved one."""
    return await conn.fetchval(Q["offset_read"], listener)


async def read_stream(
    conn: asyncpg.Connection, listener: str, after: int, limit: int = STREAM_BATCH
) -> list[StreamEvent]:
    """Up to ``limit`` settled events mentioning ``listener`` with seq > ``after``, in order."""
    rows = await conn.fetch(Q["stream_read"], listener, after, limit)
    return [
        StreamEvent(
            seq=r["seq"],
            id=r["id"],
            channel=r["channel"],
            author=r["author"],
            content=r["content"],
            mentions=list(r["mentions"]),
            meta=json.loads(r["meta"]),
            accepted_at=r["accepted_at"],
        )
        for r in rows
    ]


async def get_stream_listener(conn: asyncpg.Connection, name: str) -> StreamListener | None:
    """The listener's name and stream-token hash (for stream auth), or None if unknown."""
    row = await conn.fetchrow(Q["stream_listener"], name)
    if row is None:
        return None
    return StreamListener(name=row["name"], stream_token_hash=row["stream_token_hash"])
