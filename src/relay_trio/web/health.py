"""Liveness and readiness."""

from __future__ import annotations

from quart import Blueprint, jsonify

from relay_trio.db import DatabaseUnavailable
from relay_trio.migrations import pending_migrations_tx
from relay_trio.web.context import pod

bp = Blueprint("health", __name__)


@bp.get("/healthz")
async def healthz():
    return jsonify({"status": "ok", "pod": pod().pod_id})


async def readiness_problems() -> tuple[list[str], dict]:
    p = pod()
    problems: list[str] = []
    detail: dict = {}
    try:
        pending = await p.db.run(pending_migrations_tx, timeout=2.0)
        if pending:
            problems.append("migrations_pending: " + ", ".join(f"{m.version:04d}_{m.name}" for m in pending))
    except DatabaseUnavailable as exc:
        problems.append(f"database_unreachable: {exc}")
    for name, alive in sorted(p.tasks_alive.items()):
        if not alive:
            problems.append(f"task_down: {name}")
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
    body = {"status": "ready" if not problems else "not_ready", "problems": problems, **detail}
    resp = jsonify(body)
    resp.status_code = 200 if not problems else 503
    return resp
