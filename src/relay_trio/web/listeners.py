"""The listener registry API: PUT/GET/DELETE /listeners (admin token).

PUT creates (201: the secret and a per-listener stream token are shown this once) or
updates (200). Reads never show secrets. DELETE ends the listener's pending deliveries
as dead ('listener_deleted'). Every write NOTIFYs the registry channel in its
transaction so every pod's route cache follows within a second.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
import urllib.parse
from typing import Any

from quart import Blueprint, Response, jsonify

from relay_trio.intake import ValidationFailed, check_name
from relay_trio.store.listeners import delete_listener, get_listener, list_listeners, upsert_listener
from relay_trio.web.auth import require_admin
from relay_trio.web.context import pod
from relay_trio.web.errors import ApiError
from relay_trio.web.jsonbody import read_json_body

bp = Blueprint("listeners", __name__)

LISTENER_FIELDS = ("url", "secret", "enabled")
MAX_URL_CHARS = 2048
SECRET_PREFIX = "whsec_"
SECRET_MIN_BYTES, SECRET_MAX_BYTES = 16, 64


def generate_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode("ascii")


def generate_stream_token() -> tuple[str, str]:
    """(token shown once to the client, sha256 hex stored in listeners.stream_token_hash)."""
    token = secrets.token_urlsafe(24)
    return token, hashlib.sha256(token.encode("ascii")).hexdigest()


def _bad(code: str, field: str | None, message: str) -> ApiError:
    return ApiError(400, code, {"field": field, "message": message})


def _name(name: str) -> str:
    try:
        return check_name("name", name)
    except ValidationFailed as exc:
        raise _bad(exc.code, exc.field, exc.message) from None


def _check_url(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _bad("invalid_field", "url", "must be a non-empty string")
    if len(value) > MAX_URL_CHARS:
        raise _bad("invalid_field", "url", f"must be at most {MAX_URL_CHARS} characters")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in value) or not value.isascii():
        raise _bad("invalid_field", "url", "must not contain whitespace, control or non-ASCII characters")
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise _bad("invalid_field", "url", "is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _bad("invalid_field", "url", "must be an absolute http or https URL")
    return value


def _check_secret(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(SECRET_PREFIX):
        raise _bad("invalid_field", "secret", f"must be a string '{SECRET_PREFIX}<base64>'")
    try:
        raw = base64.b64decode(value[len(SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise _bad("invalid_field", "secret", f"must be '{SECRET_PREFIX}' followed by valid base64") from None
    if not SECRET_MIN_BYTES <= len(raw) <= SECRET_MAX_BYTES:
        raise _bad("invalid_field", "secret", f"must encode {SECRET_MIN_BYTES}-{SECRET_MAX_BYTES} bytes")
    return value


def parse_listener_body(body: Any) -> tuple[str, str | None, bool | None]:
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_body", {"field": None, "message": "the body must be a JSON object"})
    for key in body:
        if key not in LISTENER_FIELDS:
            raise _bad("unknown_field", str(key)[:128], "unknown field")
    if "url" not in body:
        raise _bad("missing_field", "url", "is required")
    url = _check_url(body["url"])
    secret = _check_secret(body["secret"]) if "secret" in body else None
    enabled = body.get("enabled")
    if "enabled" in body and not isinstance(enabled, bool):
        raise _bad("invalid_field", "enabled", "must be true or false")
    return url, secret, enabled


def _poke_registry() -> None:
    registry = pod().registry
    if registry is not None:
        registry.poke()


@bp.put("/listeners/<name>")
async def put_listener(name: str):
    require_admin()
    name = _name(name)
    url, secret, enabled = parse_listener_body(await read_json_body())
    new_secret = secret or generate_secret()
    stream_token, stream_token_hash = generate_stream_token()
    created, view = await pod().db.run(
        upsert_listener,
        name,
        url,
        new_secret,
        secret is not None,
        enabled,
        stream_token_hash,
    )
    _poke_registry()
    if created:
        view = {**view, "secret": new_secret, "stream_token": stream_token}
    resp = jsonify(view)
    resp.status_code = 201 if created else 200
    return resp


@bp.get("/listeners")
async def get_listeners():
    require_admin()
    return jsonify({"listeners": await pod().db.run(list_listeners)})


@bp.get("/listeners/<name>")
async def get_one_listener(name: str):
    require_admin()
    name = _name(name)
    view = await pod().db.run(get_listener, name)
    if view is None:
        raise ApiError(404, "listener_not_found", {"name": name})
    return jsonify(view)


@bp.delete("/listeners/<name>")
async def delete_one_listener(name: str):
    require_admin()
    name = _name(name)
    ended = await pod().db.run(delete_listener, name)
    if ended is None:
        raise ApiError(404, "listener_not_found", {"name": name})
    _poke_registry()
    return Response("", status=204)
