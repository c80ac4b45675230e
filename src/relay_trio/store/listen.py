"""Asyncio-side operations of the LISTEN/NOTIFY listener's dedicated connection.

Called from trio through ``relay_trio.db.on_connection`` (one crossing each). LISTEN goes
through asyncpg's ``add_listener``, which registers the callback and sends
``LISTEN <quoted identifier>`` (asyncpg quotes exactly like ``db.quote_ident``: double the
double quotes, wrap in double quotes); channel names are validated before they get here
(``channels.check_channel_name``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import asyncpg

from relay_trio.channels import check_notify_payload
from relay_trio.queries import Q

NotificationCallback = Callable[[Any, int, str, str], None]


async def listen_channels(conn: asyncpg.Connection, channels: Iterable[str], callback: NotificationCallback) -> None:
    """LISTEN on every channel, each dispatching to ``callback`` (a sync function that never raises)."""
    for channel in channels:
        await conn.add_listener(channel, callback)


async def notify(conn: asyncpg.Connection, channel: str, payload: str | None) -> None:
    """pg_notify(channel, payload); refuses an oversized payload before it reaches the server."""
    check_notify_payload(channel, payload)
    await conn.execute(Q["listener_notify"], channel, payload or "")


async def listening_channels(conn: asyncpg.Connection) -> list[str]:
    """The channels this very backend is LISTENing on (pg_listening_channels())."""
    return list(await conn.fetchval(Q["listener_listening_channels"]))


async def close(conn: asyncpg.Connection) -> None:
    await conn.close()
