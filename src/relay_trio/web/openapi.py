"""GET /openapi.json: the hand-written OpenAPI 3.0 document of the public API.

Hand-written (src/relay_trio/openapi.json) rather than generated, because the handlers
validate bodies themselves; tests/test_schemathesis.py keeps the document honest by
running schemathesis against a live pod (every response must match it, no 5xx).
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from quart import Blueprint, Response

bp = Blueprint("openapi", __name__)


@lru_cache(maxsize=1)
def openapi_bytes() -> bytes:
    text = (resources.files("relay_trio") / "openapi.json").read_text(encoding="utf-8")
    json.loads(text)  # fail loudly at first use if the file is broken
    return text.encode("utf-8")


def openapi_document() -> dict:
    return json.loads(openapi_bytes())


@bp.get("/openapi.json")
async def openapi_json() -> Response:
    return Response(openapi_bytes(), status=200, content_type="application/json")
