"""Reusable real-process helpers: relay pods as child processes, and a recording webhook
listener.

* ``PodProcess``: one ``python -m relay_trio serve`` child pointed at a test database,
  bound to 127.0.0.1:0 (its URL is read from its own "serving on http://..." log line, so
  there is no free-port race), JSON logs to a file. ``wait_ready`` waits for /readyz 200;
  ``signal``/``wait_exit`` drive shutdown tests; ``log_records`` parses the JSON log.
* ``RecordingListener``: a threaded HTTP server standing in for a webhook receiver. It
  records every request (headers, JSON body, arrival time), answers ``status`` after
  ``delay`` seconds; both can be changed while it runs. Being thread-based it works from
  sync tests and from trio tests alike (``await trio.to_thread.run_sync(...)`` for waits).

Everything here uses wall-clock waits with generous bounds: these tests run on a shared
2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import signal as signal_mod
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SERVING = re.compile(r"serving on (http://[0-9.:\[\]a-z]+)")

INGEST_TOKEN = "proc-ingest-token-7f3a"
ADMIN_TOKEN = "proc-admin-token-91bd"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def http_json(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
              timeout: float = 10.0) -> tuple[int, Any]:
    """A tiny blocking JSON client (no event loop needed); returns (status, parsed body)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        status = exc.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout}s")


class PodProcess:
    """One ``relay-trio serve`` child process (JSON logs in ``log_path``)."""

    def __init__(self, database_url: str, log_path: Path, **settings: object):
        self.database_url = database_url
        self.log_path = Path(log_path)
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self.base_url = ""
        self._log = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        env.update(
            RELAY_DATABASE_URL=self.database_url,
            RELAY_BIND="127.0.0.1:0",
            RELAY_LOG_FORMAT="json",
            RELAY_SHUTDOWN_GRACE="2",
            PYTHONUNBUFFERED="1",
        )
        for key, value in self.settings.items():
            env["RELAY_" + key.upper()] = str(value)
        return env

    def start(self) -> PodProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay_trio", "serve"],
            env=self.env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        return self

    # -- logs ------------------------------------------------------------------------------
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_records(self) -> list[dict]:
        out = []
        for line in self.log_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    # -- readiness -------------------------------------------------------------------------
    def _check_alive(self) -> None:
        assert self.proc is not None, "start() first"
        if self.proc.poll() is not None:
            raise RuntimeError(f"pod exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")

    def _bound(self) -> bool:
        m = SERVING.search(self.log_text())
        if m:
            self.base_url = m.group(1).rstrip("/")
        return bool(m)

    def _ready(self) -> bool:
        self._check_alive()
        if not self.base_url and not self._bound():
            return False
        try:
            with urllib.request.urlopen(self.base_url + "/readyz", timeout=3) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 45.0) -> PodProcess:
        try:
            wait_until(self._ready, timeout, what="pod /readyz 200")
        except TimeoutError:
            raise TimeoutError(f"pod not ready in {timeout}s:\n{self.log_text()[-4000:]}") from None
        return self

    # -- signals and exit ------------------------------------------------------------------
    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, signum: int = signal_mod.SIGTERM) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; always safe to call (fixture teardown)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal_mod.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: Any
    arrived: float  # time.monotonic()


@dataclass
class RecordingListener:
    """A webhook receiver on 127.0.0.1 in a background thread.

    ``delay`` (seconds before answering) and ``status`` may be changed at any time.
    ``received`` lists completed requests; ``started`` counts requests that arrived (a
    delayed request is "started" before it is "received").
    """

    delay: float = 0.0
    status: int = 200
    received: list[Received] = field(default_factory=list)
    started: int = 0
    arrivals: list[Received] = field(default_factory=list)  # at arrival, before the delay

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                headers = {k.lower(): v for k, v in self.headers.items()}
                with outer._cond:
                    outer.started += 1
                    outer.arrivals.append(Received(self.path, headers, body, time.monotonic()))
                    outer._cond.notify_all()
                delay = outer.delay
                if delay:
                    time.sleep(delay)
                payload = b'{"ok": true}'
                try:
                    self.send_response(outer.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    self.wfile.flush()
                except OSError:  # the sender gave up (cancelled delivery): not received
                    self.close_connection = True
                    return
                with outer._cond:
                    outer.received.append(Received(self.path, headers, body, time.monotonic()))
                    outer._cond.notify_all()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="recording-listener", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/hook"

    def __enter__(self) -> RecordingListener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.received)

    def arrivals_snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.arrivals)

    def wait_for(self, predicate, timeout: float) -> bool:
        """Block until ``predicate(self)`` holds (checked on every arrival) or timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def delivery_ids(self) -> list[Any]:
        return [r.body.get("delivery_id") for r in self.snapshot() if isinstance(r.body, dict)]

    def event_ids(self) -> list[Any]:
        return [
            (r.body.get("event") or {}).get("id") for r in self.snapshot() if isinstance(r.body, dict)
        ]


class AdvisoryLockHolder:
    """Hold a session-level advisory lock from a separate connection (in a thread), e.g.
    the events trigger's lock (72604210001) to make every POST /events wait in the
    database: a request that stays in flight for as long as the test wants."""

    EVENTS_SEQ_LOCK = 72604210001

    def __init__(self, dsn: str, key: int = EVENTS_SEQ_LOCK):
        self.dsn = dsn
        self.key = key
        self._acquired = threading.Event()
        self._release = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="advisory-lock", daemon=True)

    def _run(self) -> None:
        import asyncio

        import asyncpg

        async def main() -> None:
            conn = await asyncpg.connect(self.dsn)
            try:
                await conn.execute("SELECT pg_advisory_lock($1)", self.key)
                self._acquired.set()
                while not self._release.is_set():
                    await asyncio.sleep(0.02)
                await conn.execute("SELECT pg_advisory_unlock($1)", self.key)
            finally:
                await conn.close()

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by __enter__/release
            self._error = exc
            self._acquired.set()

    def __enter__(self) -> AdvisoryLockHolder:
        self._thread.start()
        self._acquired.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def release(self) -> None:
        self._release.set()
        self._thread.join(30)

    def __exit__(self, *exc: object) -> None:
        self.release()


class Background:
    """Run a blocking call in a thread; ``result(timeout)`` returns it or re-raises."""

    def __init__(self, fn, *args, **kwargs):
        self._out: list = []
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, fn, args, kwargs) -> None:
        try:
            self._out.append(("ok", fn(*args, **kwargs)))
        except BaseException as exc:
            self._out.append(("err", exc))

    def done(self) -> bool:
        return bool(self._out)

    def result(self, timeout: float):
        self._thread.join(timeout)
        if not self._out:
            raise TimeoutError("background call still running")
        kind, value = self._out[0]
        if kind == "err":
            raise value
        return value
