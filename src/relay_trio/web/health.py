"""Liveness (/healthz) and readiness (/readyz).

/healthz answers 200 while the event loop runs: it touches nothing else, so a slow
database never gets a pod restarted. /readyz answers 200 only when this pod can do its
job: the database answers, every migration is applied, every supervised component (the
delivery loop, the listener, ...) is alive, and the pod is not shutting down. Otherwise
503 with ``{"error": "not_ready", "problems": [...]}``. A degraded listener (LISTEN/NOTIFY
unavailable, delivering on hand-off and poll only) is reported but keeps the pod ready.
"""

from __future__ import annotations

from quart import Blueprint, jsonify

from relay_trio.db import DatabaseUnavailable
from relay_trio.migrations import pending_migrations_tx
from relay_trio.web.context import pod

bp = Blueprint("health", __name__)

READINESS_DB_TIMEOUT = 2.0


@bp.get("/healthz")
async def healthz():
    return jsonify({"status": "ok", "pod": pod().pod_id})


async def readiness_problems() -> tuple[list[str], dict]:
    """(problems that make the pod not ready, details reported either way)."""
    p = pod()
    problems: list[str] = []
    detail: dict = {"pod": p.pod_id, "components": dict(sorted(p.tasks_alive.items()))}
    try:
        # One crossing answers both "database reachable" and "migrations applied".
        pending = await p.db.run(pending_migrations_tx, timeout=READINESS_DB_TIMEOUT)
        if pending:
            problems.append("migrations_pending: " + ", ".join(f"{m.version:04d}_{m.name}" for m in pending))
    except DatabaseUnavailable as exc:
        problems.append(f"database_unreachable: {exc}")
    for name, alive in sorted(p.tasks_alive.items()):
        if not alive:
            problems.append(f"component_down: {name}")
    if p.registry is not None:
        # The route cache: which registered, enabled listeners this pod delivers. A pod
        # whose RELAY_ROUTES match nothing is ready (others deliver) but says so here.
        detail["routed_listeners"] = len(p.registry.names())
        detail["routes"] = "*" if p.settings.route_set is None else sorted(p.settings.route_set)
    if p.pglistener is not None:
        status = p.pglistener.status()
        detail["listener"] = status
        if status.get("state") == "degraded":
            detail["listener_note"] = "LISTEN/NOTIFY unavailable; delivering on hand-off and poll only"
    if p.shutting_down.is_set():
        problems.append("shutting_down")
    return problems, detail


@bp.get("/readyz")
async def readyz():
    problems, detail = await readiness_problems()
    if problems:
        body = {"error": "not_ready", "detail": "; ".join(problems), "problems": problems, **detail}
    else:
        body = {"status": "ready", "problems": [], **detail}
    resp = jsonify(body)
    resp.status_code = 200 if not problems else 503
    resp.headers["Cache-Control"] = "no-store"
    return resp
