"""Standard Webhooks signatures, checked by the reference `standardwebhooks` package on a
real request received by a local HTTP server."""

from __future__ import annotations

import base64
import json
import time
from datetime import datetime, timezone

import pytest
import trio
from standardwebhooks import Webhook, WebhookVerificationError

from delivery_support import SECRET, RecordingServer
from relay_trio.config import Settings
from relay_trio.delivery import model
from relay_trio.delivery.http_client import make_http_client
from relay_trio.delivery.sender import HttpSender
from relay_trio.delivery.signing import secret_key, sign


def test_signature_matches_the_reference_implementation():
    body = b'{"a":1}'
    ts = 1_700_000_000
    assert sign(SECRET, "42", ts, body) == Webhook(SECRET).sign("42", datetime.fromtimestamp(ts, timezone.utc), body.decode())
    assert secret_key(SECRET) == b"0123456789abcdef0123456789abcdef"


def row(url: str, secret: str = SECRET) -> model.ClaimedRow:
    return model.ClaimedRow(
        id=42, listener="bot", attempt=3, token=7, url=url, secret=secret,
        event={"id": "evt-1", "seq": 9, "channel": "general", "author": "alice", "content": "hi @bot ✓",
               "mentions": ["bot"], "meta": {"thread": "t1"}, "accepted_at": datetime(2026, 1, 1, tzinfo=timezone.utc)},
    )


async def test_real_signed_request_verifies_with_standardwebhooks(nursery):
    server = RecordingServer()
    base = await server.start(nursery)
    settings = Settings(database_url="postgresql://unused", target_deny_cidrs="")
    async with make_http_client(settings) as client:
        result = await HttpSender(client, timeout=5.0).send(row(base + "/hook"))
    assert result.outcome == model.DELIVERED and result.status_code == 200
    [req] = server.requests
    assert req["method"] == "POST" and req["headers"]["content-type"] == "application/json"
    assert req["headers"]["webhook-id"] == "42"
    assert abs(int(req["headers"]["webhook-timestamp"]) - time.time()) < 60
    payload = Webhook(SECRET).verify(req["body"], req["headers"])
    assert payload == {
        "type": "mention", "delivery_id": 42, "listener": "bot", "attempt": 3,
        "event": {"id": "evt-1", "seq": 9, "channel": "general", "author": "alice", "content": "hi @bot ✓",
                  "mentions": ["bot"], "meta": {"thread": "t1"}, "accepted_at": "2026-01-01T00:00:00+00:00"},
    }
    # A different secret, or a tampered body, does not verify.
    other = "whsec_" + base64.b64encode(b"another-secret-another-secret!!").decode()
    with pytest.raises(WebhookVerificationError):
        Webhook(other).verify(req["body"], req["headers"])
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(req["body"].replace(b"alice", b"mallory"), req["headers"])
    assert json.loads(req["body"])["attempt"] == 3
