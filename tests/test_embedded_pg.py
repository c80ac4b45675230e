"""The embedded PostgreSQL cluster and `relay-trio serve` on it with no configuration."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from relay_trio import embedded_pg
from relay_trio.db import admin_fetchval_sync
from relay_trio.embedded_pg import EmbeddedPostgres, EmbeddedPostgresError, find_bindir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_binaries_give_a_one_paragraph_error(monkeypatch):
    monkeypatch.setattr(embedded_pg.shutil, "which", lambda name: None)
    monkeypatch.setattr(embedded_pg.glob, "glob", lambda pattern: [])
    with pytest.raises(EmbeddedPostgresError) as info:
        find_bindir()
    message = str(info.value)
    assert "apt-get install postgresql" in message
    assert "RELAY_DATABASE_URL" in message
    assert "\n" not in message


def test_cluster_lifecycle_reuse_and_stale_pid(cluster_dir):
    data = cluster_dir / "pg"
    first = EmbeddedPostgres(data, for_tests=True)
    first.start()
    try:
        assert first.started_here
        assert admin_fetchval_sync(first.dsn(), "SELECT current_user") == "relay"
        # A second instance on the same data dir reuses the running cluster.
        second = EmbeddedPostgres(data, for_tests=True)
        second.start()
        assert not second.started_here
        assert admin_fetchval_sync(second.dsn(), "SELECT 1") == 1
        # A killed run leaves a stale postmaster.pid behind; the next start copes.
        first.kill()
        for _ in range(100):
            if not first.is_running():
                break
            time.sleep(0.05)
        assert (data / "postmaster.pid").exists()
        third = EmbeddedPostgres(data, for_tests=True)
        third.start()
        assert third.started_here
        assert admin_fetchval_sync(third.dsn(), "SELECT 1") == 1
    finally:
        EmbeddedPostgres(data, for_tests=True).stop("immediate")


@pytest.mark.skipif(os.geteuid() != 0, reason="the unprivileged-user path only applies to root")
def test_as_root_the_server_runs_as_an_unprivileged_user(pg_server):
    if pg_server.cluster is None:
        pytest.skip("suite is using an external server")
    pid = pg_server.cluster.postmaster_pid()
    assert pid is not None
    assert os.stat(f"/proc/{pid}").st_uid != 0


def test_serve_with_no_configuration_starts_embedded_postgres(cluster_dir):
    """The README's first command in miniature: serve on the embedded default, /readyz 200,
    SIGTERM exits 0 and stops the cluster it started."""
    port = free_port()
    data_dir = cluster_dir / "relay" / "pg"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update({"RELAY_DATA_DIR": str(data_dir), "RELAY_BIND": f"127.0.0.1:{port}", "RELAY_LOG_FORMAT": "console"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay_trio", "serve"],
        env=env,
        cwd=cluster_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
                    status = resp.status
                    break
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.2)
        assert status == 200, proc.stdout.read() if proc.poll() is not None else "no answer from /readyz"
        assert (data_dir / "PG_VERSION").exists()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert not EmbeddedPostgres(data_dir).is_running(), "the cluster serve started must be stopped on exit"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        EmbeddedPostgres(data_dir).stop("immediate")
