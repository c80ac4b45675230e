"""Helpers for the delivery tests: rows in a real database, a tiny recording HTTP server."""

from __future__ import annotations

import base64
import functools
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import trio

from relay_trio.db import Database

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()


async def add_listener(db: Database, name: str, url: str = "http://127.0.0.1:9/hook", *, secret: str = SECRET,
                       enabled: bool = True) -> None:
    async def op(conn):
        await conn.execute(
            "INSERT INTO listeners (name, url, secret, enabled) VALUES ($1, $2, $3, $4)",
            name, url, secret, enabled,
        )

    await db.run(op)


async def add_rows(db: Database, listeners: Sequence[str], *, content: str = "hello") -> list[int]:
    """One event per listener name (repeats allowed), one pending outbox row each; returns ids."""

    async def op(conn):
        ids = []
        for name in listeners:
            seq = await conn.fetchval(
                "INSERT INTO events (id, channel, author, content, mentions, meta, body_hash)"
                " VALUES ($1, 'general', 'alice', $2, $3, $4::jsonb, 'x') RETURNING seq",
                f"evt-{uuid.uuid4().hex[:10]}", content, [name], json.dumps({"k": 1}),
            )
            ids.append(await conn.fetchval(
                "INSERT INTO deliveries (event_seq, listener) VALUES ($1, $2) RETURNING id", seq, name
            ))
        return ids

    return await db.run_tx(op)


async def fetch(db: Database, query: str, *args: Any) -> list[dict]:
    async def op(conn):
        return [dict(r) for r in await conn.fetch(query, *args)]

    return await db.run(op)


async def execute(db: Database, query: str, *args: Any) -> str:
    async def op(conn):
        return await conn.execute(query, *args)

    return await db.run(op)


class RecordingServer:
    """A minimal HTTP/1.1 server on 127.0.0.1 that records requests (headers + raw body).

    ``respond(path, headers, body)`` returns (status line, extra headers, body) or None to stall.
    """

    def __init__(self, respond: Callable[[str, dict, bytes], Any] | None = None) -> None:
        self.requests: list[dict] = []
        self.respond = respond or (lambda path, headers, body: ("200 OK", {}, b"ok"))
        self.port = 0
        self.connections = 0
        self.got_request = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
                length = int(headers.get("content-length", "0") or 0)
                while len(buf) < length:
                    buf += await stream.receive_some(65536)
                body, buf = buf[:length], buf[length:]
                self.requests.append({"method": method, "path": path, "headers": headers, "body": body,
                                      "at": trio.current_time()})
                self.got_request.set()
                answer = self.respond(path, headers, body)
                if answer is None:
                    await trio.sleep_forever()
                status, extra, out = answer
                head_out = f"HTTP/1.1 {status}\r\nContent-Length: {len(out)}\r\n"
                head_out += "".join(f"{k}: {v}\r\n" for k, v in extra.items())
                await stream.send_all(head_out.encode() + b"\r\n" + out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async def start(self, nursery: trio.Nursery) -> str:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self.handle, 0, host="127.0.0.1"))
        self.port = listeners[0].socket.getsockname()[1]
        return f"http://127.0.0.1:{self.port}"
