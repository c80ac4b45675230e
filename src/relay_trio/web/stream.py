"""Pull delivery: Server-Sent Events of a listener's stream, and its saved offset.

``GET /listeners/<name>/stream`` sends every event that mentions the listener, in seq
order, each as ``id: <seq>`` + ``data: <event JSON>``. It starts after ``?after=``, else
after ``Last-Event-ID`` (what an EventSource sends on reconnect), else after the saved
offset, else from the beginning.

Why it never misses an event: the stream keeps a cursor (the last seq sent) and re-reads
``seq > cursor`` on every wake: a NOTIFY on ``relay_events`` after intake commits, the
wake-all the Postgres listener sends after it reconnects, and a periodic re-read as a
safety net. The read itself only returns settled rows (store.offsets), so a cursor never
passes a seq that can still commit.

Lifetime: the generator holds one listener subscription and no connection between reads.
A client disconnect cancels the request (quart-trio), which ends the generator and closes
the subscription; ``pod.shutting_down`` ends every open stream at its next wait, so a
graceful shutdown is not held up by idle streams.

``PUT /listeners/<name>/offset {"seq": N}`` saves the consumer's offset (monotonic, 409 on
a lower value). Both routes take the admin token or the listener's own stream token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Blueprint, current_app, jsonify, make_response, request

from relay_trio import channels
from relay_trio.db import DatabaseUnavailable
from relay_trio.intake import NAME_RE
from relay_trio.runtime import Pod
from relay_trio.store.offsets import (
    STREAM_BATCH,
    OffsetRegression,
    StreamEvent,
    StreamListener,
    get_stream_listener,
    read_offset,
    read_stream,
    save_offset_tx,
)
from relay_trio.web.context import pod
from relay_trio.web.errors import ApiError
from relay_trio.web.jsonbody import read_json_body

from relay_trio.web.auth import require_admin

log = logging.getLogger("relay_trio.web.stream")

bp = Blueprint("stream", __name__)

MAX_SEQ = 2**63 - 1  # seq is a bigint: larger values would fail in the driver, not with a 400


# -- auth -------------------------------------------------------------------------------
def _bearer_token() -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def stream_token_matches(token: str | None, token_hash: str | None) -> bool:
    """Constant-time check of a presented token against the stored sha256 hex digest."""
    if not token or not token_hash:
        return False
    digest = hashlib.sha256(token.encode("utf-8")).hexdigest()
    return hmac.compare_digest(digest.encode("ascii"), token_hash.strip().lower().encode("ascii", "replace"))


async def authorize(name: str) -> StreamListener:
    """The listener, if the caller holds its stream token or the admin token.

    An unknown listener is only revealed (404) to an admin: anyone else gets 401 either way.
    """
    # A name no listener can have (NUL, too long, ...) is not looked up: PostgreSQL text
    # refuses NUL, and the answer is "not found" anyway.
    listener = await pod().db.run(get_stream_listener, name) if NAME_RE.fullmatch(name) else None
    if listener is not None and stream_token_matches(_bearer_token(), listener.stream_token_hash):
        return listener
    require_admin()
    if listener is None:
        raise ApiError(404, "listener_not_found", f"no listener named {name!r}")
    return listener


# -- parameters ---------------------------------------------------------------------------
def _parse_seq(raw: str, source: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ApiError(400, "invalid_cursor", f"{source} must be a non-negative integer seq") from None
    if not 0 <= value <= MAX_SEQ:
        raise ApiError(400, "invalid_cursor", f"{source} must be a non-negative integer seq")
    return value


async def starting_cursor(p: Pod, name: str) -> int:
    """?after=, else Last-Event-ID, else the saved offset, else 0."""
    after = request.args.get("after")
    if after is not None:
        return _parse_seq(after, "after")
    last_id = request.headers.get("Last-Event-ID")
    if last_id is not None and last_id.strip():
        return _parse_seq(last_id, "Last-Event-ID")
    saved = await p.db.run(read_offset, name)
    return saved or 0


# -- the stream ---------------------------------------------------------------------------
def format_event(event: StreamEvent) -> bytes:
    data = json.dumps(event.as_json(), separators=(",", ":"), ensure_ascii=False)
    return f"id: {event.seq}\nevent: event\ndata: {data}\n\n".encode("utf-8")


PING = b": ping\n\n"


async def wait_for_wake(sub: Any, stop: trio.Event, timeout: float) -> None:
    """Return on a wake (all pending ones drained), on ``stop``, or after ``timeout``.

    Opened and closed between two yields of the stream generator, never across one.
    """
    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:

            async def on_wake() -> None:
                if sub is None:
                    await trio.sleep_forever()
                try:
                    await sub.receive()
                    while True:  # several wakes, one re-read
                        sub.receive_nowait()
                except (trio.WouldBlock, trio.ClosedResourceError):
                    pass
                nursery.cancel_scope.cancel()

            async def on_stop() -> None:
                await stop.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_wake)
            nursery.start_soon(on_stop)


def subscribe_events(p: Pod) -> Any:
    listener = p.pglistener
    if listener is None:
        return None
    try:
        return listener.subscribe(channels.EVENTS)
    except Exception:  # never refuse a stream because wakes are unavailable: the poll remains
        log.exception("cannot subscribe to %s; the stream relies on its periodic re-read", channels.EVENTS)
        return None


def stream_read_limiter() -> trio.CapacityLimiter:
    """One per app: at most half the pool serves stream reads at a time.

    A NOTIFY wakes every open stream at once; without a bound, N streams would queue N
    acquires on the pool and intake would answer 503 (pool busy) during the burst.
    """
    limiter = current_app.extensions.get("relay_stream_reads")
    if limiter is None:
        limiter = trio.CapacityLimiter(max(1, pod().settings.pool_max_size // 2))
        current_app.extensions["relay_stream_reads"] = limiter
    return limiter


async def event_stream(p: Pod, name: str, cursor: int, limiter: trio.CapacityLimiter) -> AsyncIterator[bytes]:
    """The SSE body. Cleanup is synchronous: it may run while the request is cancelled."""
    sub = subscribe_events(p)
    p.metrics.streams_open.inc()
    log.info("stream opened", extra={"listener": name, "after": cursor})
    settings = p.settings
    try:
        yield b"retry: 1000\n: connected\n\n"
        next_ping = trio.current_time() + settings.stream_heartbeat
        while not p.shutting_down.is_set():
            try:
                async with limiter:
                    events = await p.db.run(read_stream, name, cursor, STREAM_BATCH)
            except DatabaseUnavailable as exc:
                # Keep the connection: the cursor has not moved, the next read catches up.
                log.warning("stream read failed: %s", exc, extra={"listener": name})
                events = []
            for event in events:
                yield format_event(event)
                cursor = event.seq
                p.metrics.stream_events_sent.inc()
            if events:
                next_ping = trio.current_time() + settings.stream_heartbeat
                if len(events) == STREAM_BATCH:
                    continue  # more may be waiting: read on before sleeping
            now = trio.current_time()
            if now >= next_ping:
                yield PING
                next_ping = now + settings.stream_heartbeat
            await wait_for_wake(sub, p.shutting_down, min(settings.stream_poll, max(next_ping - now, 0.0)))
    finally:
        if sub is not None:
            sub.close()
        p.metrics.streams_open.dec()
        log.info("stream closed", extra={"listener": name, "cursor": cursor})


@bp.get("/listeners/<name>/stream")
async def stream(name: str):
    p = pod()
    await authorize(name)
    if p.shutting_down.is_set():
        raise ApiError(503, "shutting_down", "this pod is shutting down; reconnect", {"Retry-After": "1"})
    cursor = await starting_cursor(p, name)
    response = await make_response(event_stream(p, name, cursor, stream_read_limiter()))
    response.headers["Content-Type"] = "text/event-stream; charset=utf-8"
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    response.timeout = None  # Quart's RESPONSE_TIMEOUT (60 s) would cut the stream
    return response


@bp.put("/listeners/<name>/offset")
async def put_offset(name: str):
    p = pod()
    await authorize(name)
    body = await read_json_body()
    seq = body.get("seq") if isinstance(body, dict) else None
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= MAX_SEQ:
        raise ApiError(400, "invalid_offset", 'body must be {"seq": <non-negative integer>}')
    try:
        saved = await p.db.run_tx(save_offset_tx, name, seq)
    except OffsetRegression as exc:
        raise ApiError(
            409, "offset_regression", {"message": "offsets only move forward", "current": exc.current}
        ) from None
    return jsonify({"listener": name, "seq": saved})


@bp.get("/listeners/<name>/offset")
async def get_offset(name: str):
    p = pod()
    await authorize(name)
    return jsonify({"listener": name, "seq": await p.db.run(read_offset, name)})
