"""A minimal keep-alive HTTP/1.1 client for the load generator.

Why not httpx: on a 2-core box the producers share the CPU with the pod and PostgreSQL;
a client that costs a few microseconds per request keeps the measurement about the relay.
One ``Conn`` is one TCP connection used by one producer at a time (no pipelining).
"""

from __future__ import annotations

import asyncio
import json
import time


class HttpError(Exception):
    pass


class Conn:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (OSError, ConnectionError):
                pass
            self.writer = None

    async def request(self, method: str, path: str, body: object | None = None, *, token: str | None = None):
        """Returns (status, parsed JSON or raw bytes, t_sent_ns, t_done_ns).

        t_done_ns is stamped right after the last byte of the response is read."""
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-length: {len(payload)}\r\n"
            + ("content-type: application/json\r\n" if body is not None else "")
            + (f"authorization: Bearer {token}\r\n" if token else "")
            + "\r\n"
        ).encode() + payload
        for attempt in (0, 1):
            if self.writer is None:
                await self._connect()
            assert self.reader is not None and self.writer is not None
            try:
                t_sent = time.time_ns()
                self.writer.write(head)
                status_line = await self.reader.readline()
                if not status_line:
                    raise ConnectionResetError("closed")
                status = int(status_line.split(b" ", 2)[1])
                length = 0
                chunked = False
                close = False
                while True:
                    line = await self.reader.readline()
                    if line in (b"\r\n", b""):
                        break
                    k, _, v = line.partition(b":")
                    k = k.strip().lower()
                    if k == b"content-length":
                        length = int(v.strip())
                    elif k == b"transfer-encoding" and b"chunked" in v.lower():
                        chunked = True
                    elif k == b"connection" and b"close" in v.lower():
                        close = True
                if chunked:
                    data = bytearray()
                    while True:
                        size = int((await self.reader.readline()).split(b";")[0], 16)
                        data += await self.reader.readexactly(size + 2)
                        if size == 0:
                            break
                        del data[-2:]
                    raw = bytes(data)
                else:
                    raw = await self.reader.readexactly(length) if length else b""
                t_done = time.time_ns()
                if close:
                    await self.close()
                try:
                    parsed = json.loads(raw) if raw else None
                except ValueError:
                    parsed = raw
                return status, parsed, t_sent, t_done
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                await self.close()
                if attempt:
                    raise
        raise HttpError("unreachable")
