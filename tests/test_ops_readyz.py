"""/readyz: database, migrations, component liveness, degraded listener, and a real
database outage (a dedicated cluster this test stops and starts; never the session one)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import httpx
import pytest
import trio

from conftest import make_settings
from relay_trio import migrations, service
from relay_trio.service import run_pod


async def test_ready_pod_reports_components_and_listener(pod_factory):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.get("/readyz")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["status"] == "ready" and body["problems"] == []
    assert body["components"]["pglistener"] is True
    assert body["listener"]["state"] == "connected"


async def test_a_component_that_cannot_start_makes_the_pod_not_ready(pod_factory, monkeypatch):
    async def broken_component(pod, *, task_status=trio.TASK_STATUS_IGNORED):
        raise RuntimeError("cannot start")

    original = service.components
    monkeypatch.setattr(service, "components", lambda pod: original(pod) + [("broken", broken_component)])
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.get("/readyz")
    assert resp.status_code == 503
    body = resp.json()
    assert body["error"] == "not_ready"
    assert body["problems"] == ["component_down: broken"]
    assert body["components"]["broken"] is False


async def test_pending_migration_makes_the_pod_not_ready(pod_factory, monkeypatch):
    pod = await pod_factory()
    original = migrations.load_migrations
    monkeypatch.setattr(
        migrations, "load_migrations",
        lambda: original() + [migrations.Migration(9999, "from_the_future", "SELECT 1")],
    )
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.get("/readyz")
    assert resp.status_code == 503
    assert resp.json()["problems"] == ["migrations_pending: 9999_from_the_future"]


async def test_degraded_listener_is_reported_but_the_pod_stays_ready(pod_factory, monkeypatch):
    pod = await pod_factory()
    status = dict(pod.pglistener.status(), state="degraded")
    monkeypatch.setattr(pod.pglistener, "status", lambda: status)
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.get("/readyz")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["listener"]["state"] == "degraded"
    assert "poll" in body["listener_note"]


async def _wait_status(client: httpx.AsyncClient, status: int, timeout: float) -> dict:
    last = None
    with trio.move_on_after(timeout):
        while True:
            try:
                resp = await client.get("/readyz")
                last = (resp.status_code, resp.text)
                if resp.status_code == status:
                    return resp.json()
            except httpx.HTTPError as exc:
                last = repr(exc)
            await trio.sleep(0.2)
    raise AssertionError(f"/readyz never answered {status} within {timeout}s; last: {last}")


def _stop(cluster) -> None:
    """Stop the dedicated cluster and make sure it is down (diagnostics if not)."""
    cluster.stop("fast")
    if cluster.is_running():
        cluster.stop("immediate")
    if cluster.is_running():
        tail = "\n".join(cluster.log_file.read_text(errors="replace").splitlines()[-20:])
        raise AssertionError(f"the dedicated cluster did not stop:\n{tail}")


@pytest.mark.timeout(180)
async def test_readyz_flips_to_503_when_the_database_stops_and_back_when_it_returns():
    from relay_trio.embedded_pg import EmbeddedPostgres

    # Not in tmp_path: when running as root the server runs as an unprivileged user that
    # must traverse the path, and any pytest session starting meanwhile (other engineers,
    # CI shards) resets /tmp/pytest-of-<user> to 0700, after which pg_ctl cannot reach the
    # data directory to stop it. A private mkdtemp directory under /tmp stays reachable.
    base = Path(tempfile.mkdtemp(prefix="relay-readyz-pg-"))
    cluster = EmbeddedPostgres(base / "data", for_tests=True)
    await trio.to_thread.run_sync(cluster.start)
    try:
        settings = make_settings(cluster.dsn(), heartbeat_interval=0.5, heartbeat_timeout=0.5)
        async with trio.open_nursery() as nursery:
            pod = await nursery.start(run_pod, settings, settings.database_url)
            async with httpx.AsyncClient(base_url=pod.base_url, timeout=10) as client:
                await _wait_status(client, 200, 10)
                await trio.to_thread.run_sync(_stop, cluster)
                body = await _wait_status(client, 503, 20)
                assert body["error"] == "not_ready"
                assert any(p.startswith("database_unreachable") for p in body["problems"]), body
                await trio.to_thread.run_sync(cluster.start)
                body = await _wait_status(client, 200, 30)
                assert body["problems"] == []
                # /healthz never depended on the database
                assert (await client.get("/healthz")).status_code == 200
            pod.shutting_down.set()
    finally:
        await trio.to_thread.run_sync(cluster.stop, "immediate")
        shutil.rmtree(base, ignore_errors=True)
