"""``relay-trio serve`` as a real process: SIGTERM drains and exits 0, an in-flight
request still gets its answer, a second signal exits at once, logs are JSON lines with
the pod id and no configured secret."""

from __future__ import annotations

import json
import signal
import time

import pytest

from proc_helpers import ADMIN_TOKEN, INGEST_TOKEN, AdvisoryLockHolder, Background, PodProcess, auth, http_json

pytestmark = pytest.mark.timeout(120)


# a backend of this database blocked on the advisory lock (the event insert's trigger)
WAITING_ON_LOCK = (
    "SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database() "
    "AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
)


def _event(i: int) -> dict:
    return {"id": f"cli-{i}", "channel": "c", "author": "a", "content": "hello"}


def _wait_in_db(database_url: str, predicate_sql: str, timeout: float) -> None:
    from relay_trio.db import admin_fetchval_sync

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if admin_fetchval_sync(database_url, predicate_sql):
            return
        time.sleep(0.05)
    raise TimeoutError(predicate_sql)


def test_sigterm_exits_zero_and_logs_are_json_with_pod_id_and_no_secrets(database_url, tmp_path):
    pod = PodProcess(database_url, tmp_path / "pod.log", pod_id="cli-pod-1",
                     ingest_tokens=INGEST_TOKEN, admin_token=ADMIN_TOKEN).start()
    try:
        pod.wait_ready()
        status, _ = http_json("POST", pod.base_url + "/events", _event(0), auth("wrong-token"))
        assert status == 401
        status, _ = http_json("POST", pod.base_url + "/events", _event(1), auth(INGEST_TOKEN))
        assert status == 202
        t0 = time.monotonic()
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit(30) == 0
        took = time.monotonic() - t0
    finally:
        pod.stop()
    assert took < 10, f"idle pod took {took:.1f}s to shut down"
    text = pod.log_text()
    lines = [line for line in text.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON record
    assert records and all(r["pod"] == "cli-pod-1" for r in records)
    msgs = [r["msg"] for r in records]
    assert any("graceful shutdown started" in m for m in msgs)
    assert any("graceful shutdown finished" in m for m in msgs)
    assert INGEST_TOKEN not in text and ADMIN_TOKEN not in text


def test_in_flight_request_is_answered_during_shutdown(database_url, tmp_path):
    pod = PodProcess(database_url, tmp_path / "pod.log", shutdown_grace=20, db_timeout=20).start()
    try:
        pod.wait_ready()
        with AdvisoryLockHolder(database_url) as lock:
            call = Background(http_json, "POST", pod.base_url + "/events", _event(2), None, 60)
            _wait_in_db(database_url, WAITING_ON_LOCK, 20)
            pod.signal(signal.SIGTERM)
            time.sleep(0.5)
            assert pod.proc.poll() is None  # still draining the request
            lock.release()
            status, body = call.result(30)
        assert status == 202, body
        assert pod.wait_exit(30) == 0
    finally:
        pod.stop()


def test_second_signal_exits_at_once(database_url, tmp_path):
    pod = PodProcess(database_url, tmp_path / "pod.log", shutdown_grace=60, db_timeout=60).start()
    try:
        pod.wait_ready()
        with AdvisoryLockHolder(database_url):
            Background(http_json, "POST", pod.base_url + "/events", _event(3), None, 90)
            _wait_in_db(database_url, WAITING_ON_LOCK, 20)
            pod.signal(signal.SIGTERM)
            time.sleep(1.0)
            assert pod.proc.poll() is None  # the graceful shutdown is waiting for the request
            t0 = time.monotonic()
            pod.signal(signal.SIGTERM)
            code = pod.wait_exit(20)
            took = time.monotonic() - t0
    finally:
        pod.stop()
    assert code == 1
    assert took < 10
    assert any("exiting now" in r["msg"] for r in pod.log_records())
