"""Processes the benchmark owns: its PostgreSQL cluster, the fast listener, relay pods and
peer workers. Everything is started here and stopped here, loopback only.

The cluster is a private ``EmbeddedPostgres`` on a temp dir with real fsync (the product's
serve defaults), never the test suite's cluster. Each scenario gets a fresh database so one
scenario's backlog never leaks into the next.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.httpclient import Conn

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
WORK = BENCH / ".work"
VENV_BIN = Path(sys.executable).parent
RELAY_EXE = VENV_BIN / "relay-trio"
PEERS_VENV = WORK / "peers-venv"
PEER_PACKAGES = ["pgqueuer", "procrastinate", "psycopg[binary]", "psycopg-pool", "httpx", "asyncpg"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- PostgreSQL ------------------------------------------------------------------------------
class Cluster:
    def __init__(self, synchronous_commit: str = "on") -> None:
        from relay_trio.embedded_pg import EmbeddedPostgres

        self.tmp = Path(tempfile.mkdtemp(prefix="relay-bench-"))
        self.pg = EmbeddedPostgres(self.tmp / "pg", for_tests=False)
        self.pg.init()
        with open(self.pg.data_dir / "postgresql.conf", "a") as conf:
            # Room for several pods, peers and 32 producers; everything else stock.
            conf.write("max_connections = 300\n")
        self.pg.start()
        self.version = self.admin_fetchval("SHOW server_version")
        self.fsync = self.admin_fetchval("SHOW fsync")
        self.sync_commit = self.admin_fetchval("SHOW synchronous_commit")

    def admin_fetchval(self, sql: str, *args):
        from relay_trio.db import admin_fetchval_sync

        return admin_fetchval_sync(self.pg.dsn("postgres"), sql, *args)

    def new_database(self, name: str) -> str:
        from relay_trio.db import admin_execute_sync

        admin_execute_sync(self.pg.dsn("postgres"), f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin_execute_sync(self.pg.dsn("postgres"), f'CREATE DATABASE "{name}"')
        return self.pg.dsn(name)

    def libpq_dsn(self, name: str) -> str:
        """The same database for psycopg (peers): key=value form, unix socket."""
        return f"host={self.pg.socket_dir} port=5432 user=relay dbname={name}"

    def stop(self) -> None:
        try:
            self.pg.stop()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


# -- the fast listener -------------------------------------------------------------------------
class Listener:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.listener", "--port", "0"],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()  # "PORT n"
        self.port = int(line.split()[1])
        self.base = f"http://127.0.0.1:{self.port}"
        self._conn = Conn("127.0.0.1", self.port)
        self._lock: asyncio.Lock | None = None  # one control request at a time (shared by concurrent rows)
        self.cursor = 0

    async def _control(self, method: str, path: str):
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                status, doc, *_ = await self._conn.request(method, path)
            except BaseException:
                await self._conn.close()
                raise
        if status != 200 or not isinstance(doc, dict):
            raise RuntimeError(f"listener control {path} -> {status}")
        return doc

    def url(self, name: str, stall: bool = False) -> str:
        return f"{self.base}/{'stall' if stall else 'l'}/{name}"

    async def reset(self) -> None:
        await self._control("POST", "/__reset")
        self.cursor = 0

    async def records(self) -> list[list]:
        """All records since the last reset: [arrival_ns, listener, event_id, webhook_id]."""
        return (await self._control("GET", "/__records?since=0"))["records"]

    async def count(self) -> int:
        return (await self._control("GET", f"/__records?since={10**12}"))["n"]

    async def wait_for(self, n: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        got = await self.count()
        while got < n and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            got = await self.count()
        return got

    async def wait_quiet(self, timeout: float, quiet: float = 1.5) -> int:
        """Wait until no new record arrived for `quiet` seconds (bounded)."""
        deadline = time.monotonic() + timeout
        last, since = await self.count(), time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            n = await self.count()
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= quiet:
                break
        return last

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# -- relay pods ------------------------------------------------------------------------------------
class Pod:
    def __init__(self, name: str, dsn: str, **settings: object) -> None:
        self.name = name
        self.port = free_port()
        env = dict(os.environ)
        env.update(
            RELAY_DATABASE_URL=dsn,
            RELAY_BIND=f"127.0.0.1:{self.port}",
            RELAY_POD_ID=name,
            RELAY_LOG_LEVEL="WARNING",
            RELAY_LOG_FORMAT="json",
            RELAY_SHUTDOWN_GRACE="2",
        )
        for k, v in settings.items():
            env[f"RELAY_{k.upper()}"] = str(v).lower() if isinstance(v, bool) else str(v)
        self.settings = {k: v for k, v in settings.items()}
        self.log_path = WORK / "logs" / f"{name}-{int(time.time())}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(RELAY_EXE), "serve"], env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.conn = Conn("127.0.0.1", self.port)

    async def ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pod {self.name} exited ({self.proc.returncode}); see {self.log_path}")
            try:
                c = Conn("127.0.0.1", self.port)
                status, *_ = await c.request("GET", "/healthz")
                await c.close()
                if status == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"pod {self.name} not healthy after {timeout}s; see {self.log_path}")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return -1

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


async def start_pods(specs: list[tuple[str, str, dict]]) -> list[Pod]:
    pods = [Pod(n, d, **s) for n, d, s in specs]
    try:
        await asyncio.gather(*(p.ready() for p in pods))
    except Exception:
        for p in pods:
            p.stop()
        raise
    return pods


def stop_pods(pods: list[Pod]) -> None:
    for p in pods:
        p.stop()


async def register(pod: Pod, name: str, url: str) -> None:
    status, doc, *_ = await pod.conn.request("PUT", f"/listeners/{name}", {"url": url, "enabled": True})
    if status not in (200, 201):
        raise RuntimeError(f"PUT /listeners/{name} -> {status} {doc}")


# -- peers venv --------------------------------------------------------------------------------------
def ensure_peers_venv(log) -> tuple[bool, str]:
    """Create bench/.work/peers-venv and install the peers from PyPI (once)."""
    py = PEERS_VENV / "bin" / "python"
    if not py.exists():
        r = subprocess.run([_base_python(), "-m", "venv", str(PEERS_VENV)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return False, f"venv creation failed: {r.stderr.strip()[-800:]}"
    probe = subprocess.run([str(py), "-c", "import pgqueuer, procrastinate, psycopg, httpx, asyncpg"], capture_output=True, text=True)
    if probe.returncode != 0:
        log("installing peers into bench/.work/peers-venv (pip) ...")
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", *PEER_PACKAGES], capture_output=True, text=True)
        if r.returncode != 0:
            return False, f"pip install failed: {r.stderr.strip()[-800:]}"
    return True, ""


def _base_python() -> str:
    return getattr(sys, "_base_executable", None) or shutil.which("python3") or "python3"


def peer_versions() -> dict[str, str]:
    py = PEERS_VENV / "bin" / "python"
    code = (
        "import importlib.metadata as m, json;"
        "print(json.dumps({p: m.version(p) for p in ['pgqueuer','procrastinate','psycopg','asyncpg','httpx']}))"
    )
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return {}


class PeerWorker:
    def __init__(self, system: str, dsn: str, url: str, concurrency: int = 10, seconds: float = 600) -> None:
        self.log_path = WORK / "logs" / f"peer-{system}-{int(time.time())}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(PEERS_VENV / "bin" / "python"), str(BENCH / "peers" / "job.py"), "--system", system, "--dsn", dsn,
             "worker", "--url", url, "--concurrency", str(concurrency), "--seconds", str(seconds)],
            stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        line = self.proc.stdout.readline()
        if "READY" not in line:
            self.proc.wait(5)
            raise RuntimeError(f"peer worker {system} did not start: {self.log_path.read_text()[-1500:]}")

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def peer_run(system: str, dsn: str, *args: str, timeout: float = 600) -> dict:
    r = subprocess.run(
        [str(PEERS_VENV / "bin" / "python"), str(BENCH / "peers" / "job.py"), "--system", system, "--dsn", dsn, *args],
        capture_output=True, text=True, timeout=timeout,
    )
    if r.returncode != 0:
        raise RuntimeError(f"peer {system} {args[0]} failed: {r.stderr.strip()[-1500:]}")
    return json.loads(r.stdout) if r.stdout.strip() else {}


# -- machine ----------------------------------------------------------------------------------------
def machine_info(cluster: Cluster | None) -> dict:
    load = os.getloadavg()
    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "postgres": cluster.version if cluster else "?",
        "fsync": cluster.fsync if cluster else "?",
        "synchronous_commit": cluster.sync_commit if cluster else "?",
        "loadavg_at_start": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "kernel": platform.release(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"
