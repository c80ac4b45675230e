"""Misbehaving webhook endpoints and producer threads for tests/test_faults.py.

proc_helpers (the ops engineer's) provides the pod process and the well-behaved recording
listener; this module adds endpoints that hang, reset, redirect or refuse, and a pool of
producer threads that POST events and record every answer.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx


class _ThreadedTcp:
    """A listening socket on 127.0.0.1 with one thread per accepted connection."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.requests = 0
        self._stop = threading.Event()
        self._open: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def _accept_loop(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._serve_safely, args=(conn,), daemon=True).start()

    def _serve_safely(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except OSError:
            pass

    @staticmethod
    def read_request(conn: socket.socket) -> bytes:
        conn.settimeout(10)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return buf
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v.strip())
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            rest += chunk
        return head

    def serve(self, conn: socket.socket) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for conn in self._open:
            try:
                conn.close()
            except OSError:
                pass
        self.sock.close()


class HangingEndpoint(_ThreadedTcp):
    """Reads the request and never answers (until the test ends)."""

    def serve(self, conn: socket.socket) -> None:
        self.read_request(conn)
        self.requests += 1
        self._stop.wait()


class ResettingEndpoint(_ThreadedTcp):
    """Starts a response (``prefix``), then resets the connection (RST, not FIN).

    The default prefix stops inside the header block, so no status ever arrives; pass a
    prefix with a whole status line and headers to reset in the middle of the body.
    """

    MID_HEADERS = b"HTTP/1.1 200 OK\r\nContent-Le"
    MID_BODY_AFTER_200 = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nContent-Type: application/json\r\n\r\n{\"ok\""

    def __init__(self, prefix: bytes = MID_HEADERS) -> None:
        super().__init__()
        self.prefix = prefix

    def serve(self, conn: socket.socket) -> None:
        self.read_request(conn)
        self.requests += 1
        conn.sendall(self.prefix)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()


class RedirectingEndpoint(_ThreadedTcp):
    """Answers every request with a 307 to ``location`` (which must never be followed)."""

    def __init__(self, location: str) -> None:
        super().__init__()
        self.location = location

    def serve(self, conn: socket.socket) -> None:
        while True:
            head = self.read_request(conn)
            if not head:
                return
            self.requests += 1
            conn.sendall(
                f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {self.location}\r\nContent-Length: 0\r\n\r\n".encode()
            )


def refused_url() -> str:
    """A loopback port with nothing listening (connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/hook"


@dataclass
class Answer:
    event_id: str
    status: int | None  # None: no HTTP answer at all (client timeout / connection error)
    body: Any
    started: float
    elapsed: float
    error: str | None = None


@dataclass
class Producers:
    """``count`` threads POSTing events (each mentioning ``mentions``) until stopped."""

    base_url: str
    token: str
    mentions: list[str]
    count: int = 10
    timeout: float = 15.0
    pause: float = 0.01
    answers: list[Answer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.count)]

    def _run(self, k: int) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(timeout=self.timeout) as client:
            i = 0
            while not self._stop.is_set():
                event_id = f"p{k}-{i}"
                i += 1
                body = {"id": event_id, "channel": "faults", "author": f"producer-{k}", "content": "x",
                        "mentions": self.mentions}
                t0 = time.monotonic()
                try:
                    resp = client.post(f"{self.base_url}/events", json=body, headers=headers)
                    try:
                        parsed = resp.json()
                    except ValueError:
                        parsed = resp.text
                    ans = Answer(event_id, resp.status_code, parsed, t0, time.monotonic() - t0)
                except httpx.HTTPError as exc:
                    ans = Answer(event_id, None, None, t0, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")
                with self._lock:
                    self.answers.append(ans)
                time.sleep(self.pause)

    def start(self) -> Producers:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Answer]:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)
        return list(self.answers)

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)


def accepted_ids(answers: list[Answer]) -> set[str]:
    return {a.event_id for a in answers if a.status == 202}


def summarize(answers: list[Answer]) -> dict:
    out: dict = {}
    for a in answers:
        key = str(a.status) if a.status is not None else "no_answer"
        out[key] = out.get(key, 0) + 1
    return out


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)[:2000]
