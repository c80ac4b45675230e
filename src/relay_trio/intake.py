"""Event intake: validate, save event + outbox rows in one transaction, then wake workers.

The write path of issue 3. One trio->asyncio crossing runs the whole transaction (insert
the event, resolve mentions against enabled listeners, insert one outbox row each, keep
the 202 body for idempotent replays). Only after COMMIT returned:

* ids of rows this pod routes go to this pod's delivery worker with ``send_nowait`` on
  the hand-off channel (bounded by RELAY_HANDOFF_CAPACITY; a full channel drops the id,
  counts it, and the row is woken by NOTIFY / found by the poll);
* rows this pod does not route, or whose hand-off was dropped, ask the coalescing
  notifier for a NOTIFY on the outbox channel, and every event asks for one on the
  events channel (pull streams). RELAY_NOTIFY_MODE=in-tx sends those inside the event
  transaction instead (the comparison baseline); ``off`` sends nothing.

The post-commit step never blocks and never fails the request: the event is durable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

import trio

from relay_trio import channels
from relay_trio.db import leaves_no_session_state
from relay_trio.store.events import (
    ExistingEvent,
    InsertedEvent,
    get_event_for_replay,
    insert_event_tx,
    notify_tx,
    store_response_tx,
)

log = logging.getLogger("relay_trio.intake")

NAME_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_TEXT_CHARS = 128
MAX_CONTENT_BYTES = 64 * 1024
MAX_MENTIONS = 100
MAX_META_BYTES = 16 * 1024
MAX_META_DEPTH = 32
EVENT_FIELDS = ("id", "channel", "author", "content", "mentions", "meta")


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------
class ValidationFailed(Exception):
    """A client error in the request body; ``code`` is the JSON error code."""

    def __init__(self, code: str, field: str | None, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.code = code
        self.field = field
        self.message = message

    def detail(self) -> dict[str, Any]:
        return {"field": self.field, "message": self.message}


def _invalid(field: str, message: str) -> ValidationFailed:
    return ValidationFailed("invalid_field", field, message)


def _utf8_len(field: str, value: str) -> int:
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _invalid(field, "must be valid Unicode (no lone surrogates)") from None


def _text(field: str, value: Any, *, max_chars: int | None = None, max_bytes: int | None = None) -> str:
    if not isinstance(value, str):
        raise _invalid(field, "must be a string")
    if value == "":
        raise _invalid(field, "must not be empty")
    if "\x00" in value:
        raise _invalid(field, "must not contain NUL characters")
    size = _utf8_len(field, value)
    if max_chars is not None and len(value) > max_chars:
        raise _invalid(field, f"must be at most {max_chars} characters")
    if max_bytes is not None and size > max_bytes:
        raise _invalid(field, f"must be at most {max_bytes} bytes of UTF-8")
    return value


def check_name(field: str, value: Any) -> str:
    """A listener name or event id: 1-128 characters of [A-Za-z0-9._:-]."""
    if not isinstance(value, str):
        raise _invalid(field, "must be a string")
    if not NAME_RE.fullmatch(value):
        raise _invalid(field, "must be 1-128 characters of A-Z a-z 0-9 . _ : -")
    return value


def _check_json_value(field: str, value: Any, depth: int) -> None:
    """Reject what PostgreSQL's jsonb refuses (NUL, lone surrogates, non-finite numbers)
    and deep nesting."""
    if depth > MAX_META_DEPTH:
        raise _invalid(field, f"must nest at most {MAX_META_DEPTH} levels")
    if isinstance(value, str):
        if "\x00" in value:
            raise _invalid(field, "must not contain NUL characters")
        _utf8_len(field, value)
    elif isinstance(value, float):
        if not math.isfinite(value):  # 1e400 parses as inf; jsonb has no Infinity
            raise _invalid(field, "numbers must be finite")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_json_value(field, k, depth + 1)
            _check_json_value(field, v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_json_value(field, v, depth + 1)


@dataclass(frozen=True)
class EventIn:
    id: str
    channel: str
    author: str
    content: str
    mentions: list[str]
    meta_json: str
    body_hash: str


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parse_event(body: Any) -> EventIn:
    """Validate a POST /events body; raise ValidationFailed naming the first bad field."""
    if not isinstance(body, dict):
        raise ValidationFailed("invalid_body", None, "the body must be a JSON object")
    for key in body:
        if key not in EVENT_FIELDS:
            raise ValidationFailed("unknown_field", str(key)[:128], "unknown field")
    for key in ("channel", "author", "content"):
        if key not in body:
            raise ValidationFailed("missing_field", key, "is required")

    if "id" in body:
        event_id = check_name("id", body["id"])
    else:
        event_id = f"evt-{uuid.uuid4().hex}"
    channel = _text("channel", body["channel"], max_chars=MAX_TEXT_CHARS)
    author = _text("author", body["author"], max_chars=MAX_TEXT_CHARS)
    content = _text("content", body["content"], max_bytes=MAX_CONTENT_BYTES)

    raw_mentions = body.get("mentions", [])
    if not isinstance(raw_mentions, list):
        raise _invalid("mentions", "must be a list of listener names")
    if len(raw_mentions) > MAX_MENTIONS:
        raise _invalid("mentions", f"must name at most {MAX_MENTIONS} listeners")
    mentions = list(dict.fromkeys(check_name("mentions", m) for m in raw_mentions))

    meta = body.get("meta", {})
    if not isinstance(meta, dict):
        raise _invalid("meta", "must be a JSON object")
    _check_json_value("meta", meta, 0)
    meta_json = json.dumps(meta, separators=(",", ":"), ensure_ascii=False)
    if len(meta_json.encode("utf-8")) > MAX_META_BYTES:
        raise _invalid("meta", f"must be at most {MAX_META_BYTES} bytes serialized")

    # Idempotency key material: the normalized client fields (absent optional fields and
    # their defaults hash alike; duplicate mentions collapse first).
    body_hash = hashlib.sha256(
        canonical_json(
            {"channel": channel, "author": author, "content": content, "mentions": mentions, "meta": meta}
        ).encode("utf-8")
    ).hexdigest()
    return EventIn(event_id, channel, author, content, mentions, meta_json, body_hash)


# --------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------
class IdConflict(Exception):
    """The id exists with a different body."""


class ReplayUnavailable(Exception):
    """The id conflicted but the existing event vanished before it could be read."""


@dataclass(frozen=True)
class IntakeResult:
    status: int  # 202 new, 200 replay
    body: dict[str, Any]


def routed_here(pod, listener: str) -> bool:
    route_set = pod.settings.route_set
    return route_set is None or listener in route_set


def wants_handoff(pod, listener: str) -> bool:
    return pod.settings.handoff_enabled and routed_here(pod, listener)


def join_hints(names: list[str]) -> str:
    """Comma-joined names under the NOTIFY payload limit, or "" (wake everyone) when they
    do not all fit: a pod routing only a dropped name would otherwise ignore the wake."""
    out: list[str] = []
    size = 0
    for name in names:
        extra = len(name.encode("utf-8")) + (1 if out else 0)
        if size + extra > channels.MAX_PAYLOAD_BYTES:
            return ""
        out.append(name)
        size += extra
    return ",".join(out)


def _response(ev: EventIn, inserted: InsertedEvent) -> dict[str, Any]:
    order = {name: i for i, name in enumerate(ev.mentions)}
    rows = sorted(inserted.rows, key=lambda r: (order.get(r[0], len(order)), r[1]))
    delivered = {listener for listener, _ in rows}
    return {
        "id": ev.id,
        "seq": inserted.seq,
        "accepted_at": inserted.accepted_at.isoformat(),
        "deliveries": [{"listener": listener, "delivery_id": did} for listener, did in rows],
        "unrouted": [m for m in ev.mentions if m not in delivered],
    }


@leaves_no_session_state  # the event trigger's advisory lock is released within its statement
async def _save_tx(conn, ev: EventIn, notify_in_tx: bool, pod):
    """The whole intake transaction (asyncio side; one crossing)."""
    inserted = await insert_event_tx(
        conn,
        event_id=ev.id,
        channel=ev.channel,
        author=ev.author,
        content=ev.content,
        mentions=ev.mentions,
        meta_json=ev.meta_json,
        body_hash=ev.body_hash,
    )
    if inserted is None:
        return await get_event_for_replay(conn, ev.id)
    response = _response(ev, inserted)
    await store_response_tx(conn, inserted.seq, response)
    if notify_in_tx:
        # RELAY_NOTIFY_MODE=in-tx: the baseline that NOTIFYs inside the event transaction.
        others = list(dict.fromkeys(l for l, _ in inserted.rows if not wants_handoff(pod, l)))
        if others:
            await notify_tx(conn, channels.OUTBOX, join_hints(others))
        await notify_tx(conn, channels.EVENTS, str(inserted.seq))
    return inserted, response


async def accept_event(pod, ev: EventIn) -> IntakeResult:
    """Save ``ev`` (or replay the original answer for its id), then wake workers."""
    in_tx = pod.settings.notify_mode == "in-tx"
    outcome = await pod.db.run_tx(_save_tx, ev, in_tx, pod)
    if outcome is None:
        raise ReplayUnavailable(ev.id)
    if isinstance(outcome, ExistingEvent):
        if outcome.body_hash != ev.body_hash:
            pod.metrics.events_rejected.labels("id_conflict").inc()
            raise IdConflict(ev.id)
        body = outcome.response or {"id": ev.id, "seq": outcome.seq}
        return IntakeResult(200, body)

    inserted, response = outcome
    # COMMIT has returned: from here on nothing may block or fail the request.
    try:
        pod.metrics.events_accepted.inc()
        if inserted.rows:
            pod.metrics.outbox_enqueued.inc(len(inserted.rows))
        after_commit(pod, inserted.seq, inserted.rows)
    except Exception:
        log.exception("post-commit wake-up failed (the poll will find the rows)", extra={"event_seq": inserted.seq})
    if log.isEnabledFor(logging.DEBUG):  # once per request: skip building the record when off
        log.debug("event accepted", extra={"event_id": ev.id, "event_seq": inserted.seq, "outbox_rows": len(inserted.rows)})
    return IntakeResult(202, response)


def after_commit(pod, seq: int, rows: list[tuple[str, int]]) -> None:
    """Hand routed ids to this pod's worker; ask the notifier to wake the other pods.

    Sync and non-blocking by construction (send_nowait, notifier.request).
    """
    mode = pod.settings.notify_mode
    needs_notify: dict[str, None] = {}  # listener names, ordered, deduplicated
    channel_full = False
    for listener, delivery_id in rows:
        if not wants_handoff(pod, listener):
            if mode == "coalesced":
                needs_notify[listener] = None  # in-tx mode already sent these
            continue
        if not channel_full:
            try:
                pod.handoff_send.send_nowait(delivery_id)
                pod.metrics.handoffs_sent.inc()
                continue
            except trio.WouldBlock:
                channel_full = True  # stop trying: at most `capacity` ids take the fast path
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                channel_full = True  # worker gone (shutting down)
        pod.metrics.handoffs_dropped.inc()
        needs_notify[listener] = None

    notifier = pod.notifier
    if mode == "off" or notifier is None:
        return
    for listener in needs_notify:
        notifier.request(channels.OUTBOX, listener)
    if mode == "coalesced":
        notifier.request(channels.EVENTS, str(seq))
