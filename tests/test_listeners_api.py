"""The listener registry API and the registry cache (real PostgreSQL, real pods)."""

from __future__ import annotations

import base64
import hashlib

import httpx

from intake_helpers import execute, fetch, fetchval, wait_until

URL = "http://127.0.0.1:9/hook"


async def test_create_shows_secret_and_stream_token_once(pod_factory, db):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        created = await client.put("/listeners/bot", json={"url": URL})
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["name"] == "bot" and body["url"] == URL and body["enabled"] is True
        assert body["secret"].startswith("whsec_")
        assert len(base64.b64decode(body["secret"][len("whsec_"):], validate=True)) == 24
        token = body["stream_token"]
        assert len(token) >= 32
        one = await client.get("/listeners/bot")
        many = await client.get("/listeners")
    row = (await fetch(db, "SELECT secret, stream_token_hash FROM listeners WHERE name = 'bot'"))[0]
    assert row["secret"] == body["secret"]
    assert row["stream_token_hash"] == hashlib.sha256(token.encode()).hexdigest()
    for resp in (one, many):
        assert resp.status_code == 200
        assert body["secret"] not in resp.text and token not in resp.text and row["stream_token_hash"] not in resp.text
        assert "secret" not in resp.text
    assert one.json()["url"] == URL
    assert [item["name"] for item in many.json()["listeners"]] == ["bot"]


async def test_update_is_200_and_keeps_what_was_not_sent(pod_factory, db):
    pod = await pod_factory()
    given = "whsec_" + base64.b64encode(b"k" * 32).decode()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        created = (await client.put("/listeners/bot", json={"url": URL, "secret": given, "enabled": False})).json()
        assert created["secret"] == given and created["enabled"] is False
        hash_before = await fetchval(db, "SELECT stream_token_hash FROM listeners")
        updated = await client.put("/listeners/bot", json={"url": "https://agent.example/hook"})
        assert updated.status_code == 200, updated.text
        assert "secret" not in updated.json() and "stream_token" not in updated.json()
        assert updated.json()["url"] == "https://agent.example/hook"
        assert updated.json()["enabled"] is False  # not sent: unchanged
        assert await fetchval(db, "SELECT secret FROM listeners") == given
        assert await fetchval(db, "SELECT stream_token_hash FROM listeners") == hash_before
        rotated = "whsec_" + base64.b64encode(b"r" * 24).decode()
        again = await client.put("/listeners/bot", json={"url": URL, "secret": rotated, "enabled": True})
        assert again.status_code == 200 and again.json()["enabled"] is True
        assert await fetchval(db, "SELECT secret FROM listeners") == rotated


BAD = [
    ("bad name", "/listeners/b%20ot", {"url": URL}, "invalid_field", "name"),
    ("name too long", "/listeners/" + "n" * 129, {"url": URL}, "invalid_field", "name"),
    ("missing url", "/listeners/bot", {}, "missing_field", "url"),
    ("relative url", "/listeners/bot", {"url": "/hook"}, "invalid_field", "url"),
    ("ftp url", "/listeners/bot", {"url": "ftp://agent.example/x"}, "invalid_field", "url"),
    ("no host", "/listeners/bot", {"url": "http:///x"}, "invalid_field", "url"),
    ("bad port", "/listeners/bot", {"url": "http://a.example:99999/"}, "invalid_field", "url"),
    ("url with space", "/listeners/bot", {"url": "http://a.example/a b"}, "invalid_field", "url"),
    ("url wrong type", "/listeners/bot", {"url": 5}, "invalid_field", "url"),
    ("secret without prefix", "/listeners/bot", {"url": URL, "secret": "abc"}, "invalid_field", "secret"),
    ("secret bad base64", "/listeners/bot", {"url": URL, "secret": "whsec_***"}, "invalid_field", "secret"),
    ("secret too short", "/listeners/bot", {"url": URL, "secret": "whsec_" + base64.b64encode(b"x" * 8).decode()},
     "invalid_field", "secret"),
    ("enabled wrong type", "/listeners/bot", {"url": URL, "enabled": "yes"}, "invalid_field", "enabled"),
    ("unknown field", "/listeners/bot", {"url": URL, "color": "red"}, "unknown_field", "color"),
]


async def test_validation_is_400_naming_the_field_and_changes_nothing(pod_factory, db):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        for case, path, body, code, field in BAD:
            resp = await client.put(path, json=body)
            assert resp.status_code == 400, (case, resp.text)
            assert resp.json()["error"] == code, (case, resp.text)
            assert resp.json()["detail"]["field"] == field, (case, resp.text)
        resp = await client.put("/listeners/bot", content=b"url=x", headers={"Content-Type": "text/plain"})
        assert resp.status_code == 415
        resp = await client.put("/listeners/bot", content=b"[]", headers={"Content-Type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"] == "invalid_body"
        assert (await client.get("/listeners/bad%20name")).status_code == 400
        for method in ("GET", "DELETE"):
            resp = await client.request(method, "/listeners/ghost")
            assert resp.status_code == 404 and resp.json()["error"] == "listener_not_found", method
    assert await fetchval(db, "SELECT count(*) FROM listeners") == 0


async def test_delete_ends_pending_deliveries_as_dead(pod_factory, db):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        await client.put("/listeners/bot", json={"url": URL})
        await client.put("/listeners/helper", json={"url": URL})
        for i in range(3):
            r = await client.post("/events", json={"channel": "g", "author": "a", "content": f"m{i}",
                                                   "mentions": ["bot", "helper"]})
            assert r.status_code == 202
        # One of bot's rows was already delivered: it stays delivered.
        await execute(db, """UPDATE deliveries SET status = 'delivered', delivered_at = now()
                             WHERE id = (SELECT min(id) FROM deliveries WHERE listener = 'bot')""")
        resp = await client.delete("/listeners/bot")
        assert resp.status_code == 204 and resp.content == b""
        assert (await client.get("/listeners/bot")).status_code == 404
        after = await client.post("/events", json={"channel": "g", "author": "a", "content": "x", "mentions": ["bot"]})
        assert after.json()["unrouted"] == ["bot"]
    rows = await fetch(db, "SELECT listener, status, dead_reason, lease_token FROM deliveries ORDER BY id")
    bot = [(r["status"], r["dead_reason"]) for r in rows if r["listener"] == "bot"]
    assert sorted(bot) == [("dead", "listener_deleted"), ("dead", "listener_deleted"), ("delivered", None)]
    assert {r["status"] for r in rows if r["listener"] == "helper"} <= {"pending", "delivered"}
    assert all(r["lease_token"] is None for r in rows if r["dead_reason"] == "listener_deleted")


async def test_registry_changes_reach_another_pods_cache_by_notify(pod_factory):
    writer = await pod_factory()
    # A refresh period of an hour: only the registry NOTIFY can update this cache in time.
    reader = await pod_factory(registry_refresh=3600)
    assert reader.pglistener is not None
    async with httpx.AsyncClient(base_url=writer.base_url) as client:
        await client.put("/listeners/bot", json={"url": URL})
        await wait_until(lambda: reader.registry.get("bot") is not None, timeout=5)
        await client.put("/listeners/bot", json={"url": "https://moved.example/hook"})
        await wait_until(lambda: reader.registry.get("bot").url == "https://moved.example/hook", timeout=5)
        await client.put("/listeners/bot", json={"url": URL, "enabled": False})
        await wait_until(lambda: "bot" not in reader.registry, timeout=5)
        await client.put("/listeners/bot", json={"url": URL, "enabled": True})
        await wait_until(lambda: "bot" in reader.registry, timeout=5)
        await client.delete("/listeners/bot")
        await wait_until(lambda: "bot" not in reader.registry, timeout=5)


async def test_registry_cache_holds_only_routed_listeners_and_refreshes_periodically(pod_factory, db):
    pod = await pod_factory(routes="bot,helper", registry_refresh=0.2)
    # Written behind the registry's back (no NOTIFY): only the periodic refresh sees it.
    for name in ("bot", "other"):
        await execute(db, "INSERT INTO listeners (name, url, secret) VALUES ($1, $2, 'whsec_x')", name, URL)
    await wait_until(lambda: "bot" in pod.registry, timeout=10)
    assert pod.registry.names() == ["bot"]
    assert pod.registry.routes("helper") and not pod.registry.routes("other")
    assert pod.registry.get("bot").secret == "whsec_x"
