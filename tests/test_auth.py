"""Bearer tokens: RELAY_INGEST_TOKENS guards POST /events, RELAY_ADMIN_TOKEN guards
/listeners; empty settings leave routes open, and `serve` then refuses non-loopback binds."""

from __future__ import annotations

import httpx
import pytest

from relay_trio.cli import CliError, check_auth_binding
from relay_trio.config import Settings
from relay_trio.web.auth import token_matches

EVENT = {"channel": "general", "author": "alice", "content": "hi"}
LISTENER = {"url": "http://127.0.0.1:9/hook"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


BAD_HEADERS = [
    ("missing", {}),
    ("wrong token", bearer("nope")),
    ("other route's token", bearer("admin-secret")),
    ("malformed: no scheme", {"Authorization": "ingest-one"}),
    ("malformed: basic", {"Authorization": "Basic aW5nZXN0LW9uZQ=="}),
    ("malformed: empty bearer", {"Authorization": "Bearer"}),
    ("malformed: extra parts", {"Authorization": "Bearer ingest-one extra"}),
    ("prefix of a token", bearer("ingest-on")),
    ("non-ASCII", {"Authorization": "Bearer ingést".encode("utf-8")}),
]


async def test_ingest_token_guards_post_events(pod_factory):
    pod = await pod_factory(ingest_tokens="ingest-one, ingest-two", admin_token="admin-secret")
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        for case, headers in BAD_HEADERS:
            resp = await client.post("/events", json=EVENT, headers=headers)
            assert resp.status_code == 401, (case, resp.text)
            assert resp.json()["error"] == "unauthorized", case
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        for token in ("ingest-one", "ingest-two"):  # several tokens: rotation
            resp = await client.post("/events", json=EVENT, headers=bearer(token))
            assert resp.status_code == 202, (token, resp.text)
        # Auth comes before the body: a bad body without a token is still a 401.
        resp = await client.post("/events", content=b"junk", headers={"Content-Type": "text/plain"})
        assert resp.status_code == 401


async def test_admin_token_guards_listeners(pod_factory):
    pod = await pod_factory(ingest_tokens="ingest-one", admin_token="admin-secret")
    calls = [("PUT", "/listeners/bot", LISTENER), ("GET", "/listeners", None), ("GET", "/listeners/bot", None),
             ("DELETE", "/listeners/bot", None)]
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        for method, path, body in calls:
            for case, headers in BAD_HEADERS + [("ingest token", bearer("ingest-one"))]:
                if case == "other route's token":
                    continue
                resp = await client.request(method, path, json=body, headers=headers)
                assert resp.status_code == 401, (method, path, case, resp.text)
                assert resp.json()["error"] == "unauthorized"
        ok = bearer("admin-secret")
        assert (await client.put("/listeners/bot", json=LISTENER, headers=ok)).status_code == 201
        assert (await client.get("/listeners", headers=ok)).status_code == 200
        assert (await client.get("/listeners/bot", headers=ok)).status_code == 200
        assert (await client.delete("/listeners/bot", headers=ok)).status_code == 204


async def test_empty_token_settings_leave_routes_open(pod_factory):
    pod = await pod_factory(ingest_tokens="", admin_token="")
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        assert (await client.put("/listeners/bot", json=LISTENER)).status_code == 201
        assert (await client.post("/events", json=EVENT)).status_code == 202


def test_token_compare():
    assert token_matches("a", ["b", "a"])
    assert not token_matches("a", ["b"])
    assert not token_matches("", ["a"])
    assert not token_matches("ingést", ["ingest"])


@pytest.mark.parametrize("bind", ["0.0.0.0:8080", "10.1.2.3:8080", "[::]:8080", "example.com:80"])
@pytest.mark.parametrize("tokens", [dict(ingest_tokens="", admin_token="a"), dict(ingest_tokens="i", admin_token="")])
def test_serve_refuses_non_loopback_bind_with_an_empty_token(bind, tokens):
    settings = Settings(database_url="postgresql://x@127.0.0.1/x", bind=bind, **tokens)
    with pytest.raises(CliError, match="refusing to bind"):
        check_auth_binding(settings)


@pytest.mark.parametrize("bind", ["127.0.0.1:8080", "localhost:8080", "[::1]:8080"])
def test_serve_allows_loopback_with_empty_tokens(bind):
    check_auth_binding(Settings(database_url="postgresql://x@127.0.0.1/x", bind=bind, ingest_tokens="", admin_token=""))


def test_serve_allows_any_bind_with_both_tokens_set():
    check_auth_binding(Settings(database_url="postgresql://x@127.0.0.1/x", bind="0.0.0.0:8080", ingest_tokens="i", admin_token="a"))
