"""Reading a JSON request body: 415 for other content types, 413 over the app's limit
(also for chunked bodies: Quart raises RequestEntityTooLarge while streaming, which the
error handlers render as JSON), 400 for malformed JSON.
"""

from __future__ import annotations

import json
from typing import Any

from quart import request
from werkzeug.exceptions import RequestEntityTooLarge

from relay_trio.web.errors import ApiError


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (mimetype.startswith("application/") and mimetype.endswith("+json"))


async def read_json_body() -> Any:
    if not is_json_mimetype(request.mimetype):
        raise ApiError(415, "unsupported_media_type", "send the body as Content-Type: application/json")
    try:
        data = await request.get_data(cache=False)
    except RequestEntityTooLarge:
        limit = request.max_content_length
        raise ApiError(413, "payload_too_large", f"the body is over the limit of {limit} bytes") from None
    try:
        return json.loads(data, parse_constant=_reject_constant, parse_float=lambda s: float(s) if abs(float(s)) != float("inf") else _reject_constant(f"{s[:40]} (out of range)"))
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {str(exc)[:200]}") from None
