"""Structured logs: one JSON line per record with the pod id and ids as fields; secrets
never reach the log (checked on raw records from a pod under auth failures and listener
creation, and on the redacting handler itself)."""

from __future__ import annotations

import io
import json
import logging

import httpx
import trio

from relay_trio.logs import REDACTED, ConsoleFormatter, JsonFormatter, Redactor, configure_logging, settings_secrets
from conftest import make_settings

INGEST = "ingest-tok-5b1d2c9e"
ADMIN = "admin-tok-a7f03e44"
LISTENER_SECRET = "whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQtMTIzNA=="
BODY_MARKER = "BODY-MARKER-do-not-log-3f9a"


def _record(msg: str, *args, exc: bool = False, **extra) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            import sys

            exc_info = sys.exc_info()
    record = logging.LogRecord("relay_trio.test", logging.INFO, __file__, 1, msg, args, exc_info)
    record.__dict__.update(extra)
    return record


def test_json_line_has_pod_level_logger_message_and_ids():
    line = JsonFormatter("pod-7").format(_record("delivered %s", "ok", delivery_id=42, event_id="e-1"))
    out = json.loads(line)
    assert out["pod"] == "pod-7" and out["level"] == "info" and out["logger"] == "relay_trio.test"
    assert out["msg"] == "delivered ok"
    assert out["delivery_id"] == 42 and out["event_id"] == "e-1"
    assert out["ts"].endswith("Z")


def test_a_record_with_a_multiline_traceback_is_still_one_line():
    line = JsonFormatter("p").format(_record("failed", exc=True))
    assert "\n" not in line
    assert "ValueError" in json.loads(line)["exc"]


def test_redactor_removes_configured_tokens_and_credential_shapes():
    redact = Redactor([INGEST, ADMIN, "pg-pass-99"])
    text = redact(
        f"tokens {INGEST} and {ADMIN}; header Authorization: Bearer some-other-token; "
        f"secret {LISTENER_SECRET}; dsn postgresql://relay:pg-pass-99@db:5432/relay"
    )
    for secret in (INGEST, ADMIN, "some-other-token", LISTENER_SECRET, "c2VjcmV0", "pg-pass-99"):
        assert secret not in text, (secret, text)
    assert text.count(REDACTED) >= 5
    assert "postgresql://relay:" in text and "@db:5432/relay" in text  # the rest stays readable


def test_configured_handler_redacts_in_both_formats(monkeypatch):
    settings = make_settings("postgresql://relay:pg-pass-99@db/relay", ingest_tokens=f"{INGEST},other-tok-1234",
                             admin_token=ADMIN)
    assert set(settings_secrets(settings)) == {INGEST, "other-tok-1234", ADMIN, "pg-pass-99"}
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        for fmt in ("json", "console"):
            buf = io.StringIO()
            monkeypatch.setattr("sys.stderr", buf)
            configure_logging("pod-r", fmt, "INFO", settings_secrets(settings))
            logging.getLogger("relay_trio.x").info("oops %s %s", INGEST, ADMIN, extra={"dsn": settings.database_url})
            out = buf.getvalue()
            assert "pod-r" in out
            for secret in (INGEST, ADMIN, "pg-pass-99"):
                assert secret not in out, (fmt, out)
            if fmt == "json":
                assert json.loads(out.strip())["pod"] == "pod-r"
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def _leaks(records: list[logging.LogRecord], secrets: list[str]) -> list[str]:
    found = []
    fmt = logging.Formatter()
    for r in records:
        parts = [r.getMessage(), repr({k: v for k, v in r.__dict__.items() if k not in ("msg", "args")})]
        if r.exc_info:
            parts.append(fmt.formatException(r.exc_info))
        text = " ".join(parts)
        found += [f"{s!r} in {r.name}: {r.getMessage()[:200]}" for s in secrets if s in text]
    return found


async def test_pod_never_logs_tokens_secrets_or_bodies(pod_factory, caplog):
    """Raw records (no redaction) at DEBUG: the code itself must not log secrets."""
    caplog.set_level(logging.DEBUG)
    pod = await pod_factory(ingest_tokens=INGEST, admin_token=ADMIN)
    stream_tokens = []
    async with httpx.AsyncClient(base_url=pod.base_url, timeout=10) as client:
        bearer = lambda t: {"Authorization": f"Bearer {t}"}  # noqa: E731
        # auth failures: wrong token, the other area's token, malformed header, none
        assert (await client.post("/events", json={}, headers=bearer(ADMIN))).status_code == 401
        assert (await client.put("/listeners/bot", json={"url": "http://127.0.0.1:9/x"},
                                 headers=bearer(INGEST))).status_code == 401
        assert (await client.get("/listeners", headers={"Authorization": f"Basic {ADMIN}"})).status_code == 401
        assert (await client.get("/listeners")).status_code == 401
        # listener creation with an explicit secret, and one with a generated secret
        r = await client.put("/listeners/bot", json={"url": "http://127.0.0.1:9/x", "secret": LISTENER_SECRET},
                             headers=bearer(ADMIN))
        assert r.status_code == 201, r.text
        r2 = await client.put("/listeners/gen", json={"url": "http://127.0.0.1:9/y"}, headers=bearer(ADMIN))
        assert r2.status_code == 201, r2.text
        generated = r2.json().get("secret")
        for body in (r.json(), r2.json()):
            if body.get("stream_token"):
                stream_tokens.append(body["stream_token"])
        await trio.sleep(0.3)
        r = await client.post("/events", json={"channel": "c", "author": "a", "content": BODY_MARKER,
                                                "mentions": ["bot"]}, headers=bearer(INGEST))
        assert r.status_code == 202, r.text
        await trio.sleep(0.5)
    secrets = [INGEST, ADMIN, LISTENER_SECRET, LISTENER_SECRET[len("whsec_"):], *stream_tokens]
    if generated:
        secrets += [generated, generated[len("whsec_"):]]
    assert not _leaks(caplog.records, secrets)
    assert not _leaks([r for r in caplog.records if r.levelno >= logging.INFO], [BODY_MARKER])
    assert any(r.name.startswith("relay_trio") for r in caplog.records)  # the capture worked
