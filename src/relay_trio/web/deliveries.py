"""Admin API for the outbox: list and inspect deliveries, redeliver dead or delivered ones.

    GET  /deliveries?listener=&status=pending|delivered|dead&limit=&before=
         newest first; ``next_before`` is the cursor for the next (older) page
    GET  /deliveries/<id>            the row and every recorded attempt
    POST /deliveries/<id>/redeliver  dead or delivered -> pending, due now (409 if pending)

Guarded by RELAY_ADMIN_TOKEN (``require_admin``).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import trio
from quart import Blueprint, jsonify, request

from relay_trio.store import claims
from relay_trio.web.auth import require_admin
from relay_trio.web.context import pod
from relay_trio.web.errors import ApiError

log = logging.getLogger("relay_trio.web.deliveries")

bp = Blueprint("deliveries", __name__)

STATUSES = ("pending", "delivered", "dead")
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
MAX_ID = 2**63 - 1


def _json(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def _row(rec: Any) -> dict[str, Any]:
    return {k: _json(v) for k, v in dict(rec).items()}


def _int_arg(name: str, default: int | None, lo: int, hi: int) -> int | None:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, "invalid_query", {"field": name, "message": "must be an integer"}) from None
    if not lo <= value <= hi:
        raise ApiError(400, "invalid_query", {"field": name, "message": f"must be between {lo} and {hi}"})
    return value


def _delivery_id(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(404, "delivery_not_found", {"id": raw}) from None
    if not 1 <= value <= MAX_ID:
        raise ApiError(404, "delivery_not_found", {"id": raw})
    return value


@bp.get("/deliveries")
async def list_deliveries():
    require_admin()
    status = request.args.get("status") or None
    if status is not None and status not in STATUSES:
        raise ApiError(400, "invalid_query", {"field": "status", "message": f"one of {', '.join(STATUSES)}"})
    listener = request.args.get("listener") or None
    if listener is not None and len(listener) > 128:
        raise ApiError(400, "invalid_query", {"field": "listener", "message": "at most 128 characters"})
    limit = _int_arg("limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    before = _int_arg("before", None, 1, MAX_ID)
    if listener is not None and "\x00" in listener:
        # No listener name holds NUL (and PostgreSQL text cannot): nothing can match.
        return jsonify({"deliveries": [], "next_before": None})
    rows = await pod().db.run(
        lambda conn: claims.list_deliveries(conn, listener=listener, status=status, before=before, limit=limit)
    )
    items = [_row(r) for r in rows]
    next_before = items[-1]["id"] if len(items) == limit else None
    return jsonify({"deliveries": items, "next_before": next_before})


@bp.get("/deliveries/<raw_id>")
async def get_delivery(raw_id: str):
    require_admin()
    row, attempts = await pod().db.run(claims.get_delivery, _delivery_id(raw_id))
    if row is None:
        raise ApiError(404, "delivery_not_found", {"id": raw_id})
    body = _row(row)
    body["attempts"] = [_row(a) for a in attempts]
    return jsonify(body)


@bp.post("/deliveries/<raw_id>/redeliver")
async def redeliver(raw_id: str):
    require_admin()
    p = pod()
    result, row = await p.db.run(claims.redeliver, _delivery_id(raw_id))
    if result == "not_found":
        raise ApiError(404, "delivery_not_found", {"id": raw_id})
    if result == "pending":
        raise ApiError(409, "delivery_pending", {"id": raw_id, "message": "already pending; nothing to redeliver"})
    routes = p.settings.route_set
    if p.settings.handoff_enabled and (routes is None or row["listener"] in routes):
        # Fast path to this pod's worker; a full channel is fine (the poll finds the row).
        try:
            p.handoff_send.send_nowait(row["id"])
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    log.info("delivery redelivered", extra={"delivery_id": row["id"], "listener": row["listener"]})
    return jsonify({"id": row["id"], "listener": row["listener"], "status": "pending"}), 202
