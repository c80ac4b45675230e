"""One attempt against a real local HTTP server: outcome classification, no redirects,
Retry-After, the 1 KiB response prefix, the total deadline, connection errors."""

from __future__ import annotations

import trio

from delivery_support import RecordingServer
from relay_trio.config import Settings
from relay_trio.delivery import model
from relay_trio.delivery.http_client import make_http_client
from relay_trio.delivery.sender import HttpSender


def respond(path, headers, body):
    if path == "/ok":
        return "204 No Content", {}, b""
    if path == "/gone":
        return "410 Gone", {}, b"bye"
    if path == "/throttle":
        return "429 Too Many Requests", {"Retry-After": "7"}, b"slow down"
    if path == "/unavailable":
        return "503 Service Unavailable", {}, b""
    if path == "/redirect":
        return "302 Found", {"Location": "/ok"}, b""
    if path == "/big":
        return "500 Internal Server Error", {}, b"e" * 100_000
    if path == "/stall":
        return None
    return "404 Not Found", {}, b"nope"


def row(url):
    return model.ClaimedRow(id=1, listener="bot", attempt=1, token=1, url=url, secret="whsec_c2VjcmV0",
                            event={"id": "e", "seq": 1, "channel": "c", "author": "a", "content": "x",
                                   "mentions": ["bot"], "meta": {}, "accepted_at": None})


async def test_outcomes(nursery):
    server = RecordingServer(respond)
    base = await server.start(nursery)
    settings = Settings(database_url="postgresql://unused", target_deny_cidrs="")
    async with make_http_client(settings) as client:
        sender = HttpSender(client, timeout=1.0)
        ok = await sender.send(row(base + "/ok"))
        assert (ok.outcome, ok.status_code, ok.error) == (model.DELIVERED, 204, None)
        gone = await sender.send(row(base + "/gone"))
        assert (gone.outcome, gone.status_code) == (model.GONE, 410)
        thr = await sender.send(row(base + "/throttle"))
        assert (thr.outcome, thr.retry_after, thr.response_body) == (model.THROTTLED, 7.0, "slow down")
        una = await sender.send(row(base + "/unavailable"))
        assert (una.outcome, una.retry_after) == (model.THROTTLED, None)
        n = len(server.requests)
        redir = await sender.send(row(base + "/redirect"))
        assert (redir.outcome, redir.status_code) == (model.HTTP_ERROR, 302)
        assert len(server.requests) == n + 1  # the redirect was not followed
        big = await sender.send(row(base + "/big"))
        assert big.outcome == model.HTTP_ERROR and big.response_body == "e" * 1024
        t0 = trio.current_time()
        slow = await sender.send(row(base + "/stall"))
        assert slow.outcome == model.TIMEOUT and trio.current_time() - t0 < 10
        # Nothing listens on port 9 of the loopback: a connection error, not an exception.
        refused = await sender.send(row("http://127.0.0.1:9/x"))
        assert refused.outcome == model.CONNECT_ERROR and refused.error
