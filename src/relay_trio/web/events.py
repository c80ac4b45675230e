"""POST /events: the ingest endpoint (validation and saving live in relay_trio.intake)."""

from __future__ import annotations

from quart import Blueprint, jsonify

from relay_trio.intake import IdConflict, ReplayUnavailable, ValidationFailed, accept_event, parse_event
from relay_trio.web.auth import require_ingest
from relay_trio.web.context import pod
from relay_trio.web.errors import ApiError
from relay_trio.web.jsonbody import read_json_body

bp = Blueprint("events", __name__)


@bp.post("/events")
async def post_event():
    p = pod()
    try:
        require_ingest()
        body = await read_json_body()
        ev = parse_event(body)
    except ApiError as exc:
        p.metrics.events_rejected.labels(exc.code).inc()
        raise
    except ValidationFailed as exc:
        p.metrics.events_rejected.labels(exc.code).inc()
        raise ApiError(400, exc.code, exc.detail()) from None
    try:
        result = await accept_event(p, ev)
    except IdConflict:
        raise ApiError(409, "id_conflict", {"field": "id", "message": "an event with this id exists with a different body"}) from None
    except ReplayUnavailable:
        raise ApiError(503, "retry", "the event id was being changed concurrently; retry", {"Retry-After": "1"}) from None
    resp = jsonify(result.body)
    resp.status_code = result.status
    return resp
