"""GET /metrics: this pod's Prometheus registry in the text exposition format.

Unauthenticated like /healthz and /readyz (scrapers rarely carry tokens); it holds no
secrets, ids or bodies: only counters, gauges and histograms with bounded labels.
"""

from __future__ import annotations

from quart import Blueprint, Response

from relay_trio.web.context import pod

bp = Blueprint("ops", __name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@bp.get("/metrics")
async def metrics() -> Response:
    return Response(pod().metrics.render(), status=200, content_type=PROMETHEUS_CONTENT_TYPE)
