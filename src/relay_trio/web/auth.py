"""Bearer-token checks for the HTTP API.

``require_ingest()`` guards POST /events (RELAY_INGEST_TOKENS, several allowed for
rotation); ``require_admin()`` guards /listeners and /deliveries (RELAY_ADMIN_TOKEN).
An empty setting leaves its routes open (``serve`` then refuses non-loopback binds,
see cli.check_auth_binding). Call them first in a handler, before reading the body; they
raise ApiError(401) for a missing, malformed or wrong token. Tokens are compared with
hmac.compare_digest against every configured token (no early exit).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from quart import request

from relay_trio.web.context import pod
from relay_trio.web.errors import ApiError

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="relay-trio"'}


def _presented_token() -> str:
    header = request.headers.get("Authorization")
    if header is None:
        raise ApiError(401, "unauthorized", "missing Authorization: Bearer <token> header", _CHALLENGE)
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        raise ApiError(401, "unauthorized", "malformed Authorization header; expected Bearer <token>", _CHALLENGE)
    return token


def token_matches(presented: str, allowed: Sequence[str]) -> bool:
    given = presented.encode("utf-8", "surrogateescape")
    ok = False
    for token in allowed:
        ok |= hmac.compare_digest(given, token.encode("utf-8"))
    return ok


def require_tokens(allowed: Sequence[str]) -> None:
    """Raise 401 unless the request carries one of ``allowed`` (no-op when empty)."""
    if not allowed:
        return
    if not token_matches(_presented_token(), allowed):
        raise ApiError(401, "unauthorized", "wrong bearer token", _CHALLENGE)


def require_ingest() -> None:
    require_tokens(pod().settings.ingest_token_list)


def require_admin() -> None:
    token = pod().settings.admin_token
    require_tokens([token] if token else [])


__all__ = ["require_admin", "require_ingest", "require_tokens", "token_matches"]
