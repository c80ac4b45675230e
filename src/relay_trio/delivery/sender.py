"""One delivery attempt: build the body, sign it, POST it under a trio deadline, classify.

The sender never raises for anything the endpoint or the network does: every failure
becomes an ``AttemptResult`` the store records. The deadline is a trio cancel scope (not
an httpx timeout) so it covers connect, send and reading the response as one total.
Only the first 1 KiB of a response body is read, so a hostile endpoint cannot make the
pod buffer megabytes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import httpx
import trio

from relay_trio.delivery import model
from relay_trio.delivery.schedule import parse_retry_after
from relay_trio.delivery.signing import signature_headers

log = logging.getLogger("relay_trio.delivery.sender")

RESPONSE_BODY_LIMIT = 1024


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def build_body(row: model.ClaimedRow) -> bytes:
    """The JSON body of a mention delivery (compact; these exact bytes are signed)."""
    e = row.event
    meta = e.get("meta")
    if isinstance(meta, str):
        meta = json.loads(meta)
    payload = {
        "type": "mention",
        "delivery_id": row.id,
        "listener": row.listener,
        "attempt": row.attempt,
        "event": {
            "id": e.get("id"),
            "seq": e.get("seq"),
            "channel": e.get("channel"),
            "author": e.get("author"),
            "content": e.get("content"),
            "mentions": list(e.get("mentions") or []),
            "meta": meta if meta is not None else {},
            "accepted_at": _iso(e.get("accepted_at")),
        },
    }
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def build_headers(row: model.ClaimedRow, body: bytes, timestamp: int) -> dict[str, str]:
    # webhook-id is the delivery id: stable across retries, so receivers can de-duplicate.
    headers = {"content-type": "application/json"}
    headers.update(signature_headers(row.secret, str(row.id), timestamp, body))
    return headers


def classify(status: int) -> str:
    if 200 <= status < 300:
        return model.DELIVERED
    if status == 410:
        return model.GONE
    if status in (429, 503):
        return model.THROTTLED
    return model.HTTP_ERROR


async def _read_prefix(resp: httpx.Response, limit: int) -> bytes:
    buf = bytearray()
    async for chunk in resp.aiter_raw():
        buf += chunk
        if len(buf) >= limit:
            break
    return bytes(buf[:limit])


class HttpSender:
    """Sends with the pod's one reused httpx client (redirects never followed)."""

    def __init__(self, client: httpx.AsyncClient, *, timeout: float, wallclock: Callable[[], float] = time.time):
        self.client = client
        self.timeout = timeout
        self.wallclock = wallclock

    async def send(self, row: model.ClaimedRow) -> model.AttemptResult:
        body = build_body(row)
        headers = build_headers(row, body, int(self.wallclock()))
        started_at = datetime.now(timezone.utc)
        t0 = time.perf_counter()
        status: int | None = None
        retry_after: str | None = None
        resp_body: bytes | None = None
        error: str | None = None
        with trio.move_on_after(self.timeout) as scope:
            try:
                async with self.client.stream("POST", row.url, content=body, headers=headers) as resp:
                    status = resp.status_code
                    retry_after = resp.headers.get("retry-after")
                    resp_body = await _read_prefix(resp, RESPONSE_BODY_LIMIT)
            except Exception as exc:  # noqa: BLE001 - every endpoint/network failure is an outcome
                error = f"{type(exc).__name__}: {exc}"[:500]
        duration_ms = (time.perf_counter() - t0) * 1000.0
        text = resp_body.decode("utf-8", errors="replace") if resp_body is not None else None
        if status is not None:
            outcome = classify(status)
            if scope.cancelled_caught and error is None:
                error = f"response body not read within {self.timeout:.1f}s"
            if outcome != model.DELIVERED and error is None:
                error = f"HTTP {status}"
            return model.AttemptResult(
                outcome=outcome, started_at=started_at, duration_ms=duration_ms, status_code=status,
                error=None if outcome == model.DELIVERED else error, response_body=text,
                retry_after=parse_retry_after(retry_after) if outcome == model.THROTTLED else None,
            )
        if scope.cancelled_caught:
            return model.AttemptResult(
                outcome=model.TIMEOUT, started_at=started_at, duration_ms=duration_ms,
                error=f"no response within {self.timeout:.1f}s",
            )
        return model.AttemptResult(
            outcome=model.CONNECT_ERROR, started_at=started_at, duration_ms=duration_ms, error=error,
        )
