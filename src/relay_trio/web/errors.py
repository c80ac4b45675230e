"""JSON errors: every failure a client sees is ``{"error": code, "detail": ...}``.

Handlers raise ``ApiError``; anything unexpected becomes a 500 with no traceback in the
body (the traceback goes to the log), and a lost database becomes a 503.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Quart, jsonify
from werkzeug.exceptions import HTTPException

from relay_trio.db import DatabaseUnavailable, PoolExhausted

log = logging.getLogger("relay_trio.web")


class ApiError(Exception):
    def __init__(self, status: int, code: str, detail: Any = None, headers: dict[str, str] | None = None):
        super().__init__(code)
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers or {}


def error_response(status: int, code: str, detail: Any = None, headers: dict[str, str] | None = None):
    resp = jsonify({"error": code, "detail": detail})
    resp.status_code = status
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def install_error_handlers(app: Quart) -> None:
    @app.errorhandler(ApiError)
    async def _api_error(exc: ApiError):
        return error_response(exc.status, exc.code, exc.detail, exc.headers)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException):
        status = exc.code or 500
        allow = {"Allow": ", ".join(exc.valid_methods)} if getattr(exc, "valid_methods", None) else None  # RFC 9110: 405 lists methods
        return error_response(status, _HTTP_CODES.get(status, "http_error"), exc.description, allow)

    @app.errorhandler(DatabaseUnavailable)
    async def _db_down(exc: DatabaseUnavailable):
        code = "database_busy" if isinstance(exc, PoolExhausted) else "database_unavailable"
        log.warning("request failed: %s", exc)
        return error_response(503, code, "the database is unavailable; retry later", {"Retry-After": "1"})

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception):
        log.exception("unhandled error in request handler")
        return error_response(500, "internal_error", "unexpected server error; see the server log")
