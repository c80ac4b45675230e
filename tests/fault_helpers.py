"""Real-process helpers for the fault, hostile-input and schemathesis tests.

A pod here is a real ``python -m relay_trio serve`` process (so it can be SIGKILLed),
pointed at a test database, bound to 127.0.0.1:0; its bound URL is read from its own
log line ("serving on http://..."). PostgreSQL restarts use a dedicated EmbeddedPostgres
cluster (``DedicatedCluster``), never the session cluster other tests share.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import trio

SERVING = re.compile(r"serving on (http://[0-9.:\[\]a-z]+)")

INGEST_TOKEN = "ingest-token-1"
ADMIN_TOKEN = "admin-token-s3cr3t"


class PodProcess:
    """One ``relay-trio serve`` child process."""

    def __init__(self, database_url: str, log_path: Path, **settings: object):
        self.database_url = database_url
        self.log_path = Path(log_path)
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self.base_url = ""

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        env.update(
            RELAY_DATABASE_URL=self.database_url,
            RELAY_BIND="127.0.0.1:0",
            RELAY_LOG_FORMAT="json",
            RELAY_SHUTDOWN_GRACE="2",
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

    def _poll_ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"pod exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
        m = SERVING.search(self.log_text())
        if not m:
            return False
        self.base_url = m.group(1).rstrip("/")
        try:
            with urllib.request.urlopen(self.base_url + "/healthz", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> PodProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._poll_ready():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"pod not ready in {timeout}s:\n{self.log_text()[-3000:]}")

    async def await_ready(self, timeout: float = 30.0) -> PodProcess:
        with trio.fail_after(timeout):
            while not await trio.to_thread.run_sync(self._poll_ready):
                await trio.sleep(0.05)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
