"""The fast local listener: a minimal HTTP/1.1 server that records when each request
arrives and answers 200 at once.

Why hand-rolled: it must never be the bottleneck, and every framework adds per-request
work. A plain asyncio Protocol parses the request line, headers and a Content-Length (or
chunked) body, stamps ``time.time_ns()`` (CLOCK_REALTIME, the same clock the runner stamps
POST responses with), and writes a fixed 200.

Paths:
  /l/<listener>        record and answer 200 at once
  /stall/<listener>    record, then never answer (the client's deadline ends it; capped)
  GET /__records?since=N   JSON {"n": total, "records": [[arrival_ns, listener, event_id, webhook_id], ...]}
  POST /__reset            forget every record
Run: ``python -m bench.listener --port 0`` prints ``PORT <n>`` on stdout once bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

STALL_CAP_S = 120.0
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok"


class Recorder:
    def __init__(self) -> None:
        self.records: list[tuple[int, str, str | None, str | None]] = []

    def add(self, arrival_ns: int, path: str, headers: dict[bytes, bytes], body: bytes) -> None:
        listener = path.split("/", 2)[2] if path.count("/") >= 2 else path
        event_id = None
        try:
            doc = json.loads(body)
            ev = doc.get("event")
            event_id = ev.get("id") if isinstance(ev, dict) else doc.get("id")
        except (ValueError, AttributeError):
            pass
        wid = headers.get(b"webhook-id")
        self.records.append((arrival_ns, listener, event_id, wid.decode() if wid else None))


class ListenerProtocol(asyncio.Protocol):
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.stalled = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.time_ns()
        self.buf += data
        while not self.stalled:
            req = self._parse()
            if req is None:
                return
            method, path, headers, body = req
            if path.startswith("/__"):
                self._control(method, path)
                continue
            self.rec.add(now, path, headers, body)
            if path.startswith("/stall/"):
                self.stalled = True  # never answer; the client gives up
                loop = asyncio.get_running_loop()
                loop.call_later(STALL_CAP_S, self._close)
                return
            assert self.transport is not None
            self.transport.write(OK)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _parse(self):
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = self.buf[:end].split(b"\r\n")
        try:
            method, path, _ = head[0].decode("latin-1").split(" ", 2)
        except ValueError:
            self._close()
            return None
        headers: dict[bytes, bytes] = {}
        for line in head[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        start = end + 4
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = bytearray()
            pos = start
            while True:
                nl = self.buf.find(b"\r\n", pos)
                if nl < 0:
                    return None
                size = int(self.buf[pos:nl].split(b";")[0], 16)
                if len(self.buf) < nl + 2 + size + 2:
                    return None
                body += self.buf[nl + 2 : nl + 2 + size]
                pos = nl + 2 + size + 2
                if size == 0:
                    break
            self.buf = self.buf[pos:]
            return method, path, headers, bytes(body)
        n = int(headers.get(b"content-length", b"0") or 0)
        if len(self.buf) < start + n:
            return None
        body = self.buf[start : start + n]
        self.buf = self.buf[start + n :]
        return method, path, headers, body

    def _control(self, method: str, path: str) -> None:
        assert self.transport is not None
        if path.startswith("/__records"):
            since = 0
            if "since=" in path:
                since = int(path.split("since=", 1)[1].split("&")[0])
            recs = self.rec.records
            payload = json.dumps({"n": len(recs), "records": recs[since:]}).encode()
        elif path.startswith("/__reset"):
            self.rec.records = []
            payload = b'{"ok": true}'
        else:
            payload = b'{"error": "unknown"}'
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )


async def serve(port: int) -> None:
    rec = Recorder()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ListenerProtocol(rec), "127.0.0.1", port, backlog=1024)
    bound = server.sockets[0].getsockname()[1]
    print(f"PORT {bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Bounded lifetime: the runner always stops us, but never outlive a crashed runner.
    try:
        await asyncio.wait_for(stop.wait(), timeout=4 * 3600)
    except asyncio.TimeoutError:
        pass
    server.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    asyncio.run(serve(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
