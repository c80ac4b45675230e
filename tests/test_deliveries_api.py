"""Admin API: GET /deliveries (filters, newest first, pagination), GET /deliveries/{id}
with attempts, POST /deliveries/{id}/redeliver, and the admin token."""

from __future__ import annotations

import httpx

from delivery_support import add_listener, add_rows, execute, fetch

ADMIN = {"Authorization": "Bearer admin-t"}


async def make_pod(pod_factory):
    # routes name no real listener: this pod never delivers, so row states stay as set here.
    return await pod_factory(admin_token="admin-t", routes="nobody-here")


async def test_list_filters_newest_first_and_paginates(pod_factory, db):
    pod = await make_pod(pod_factory)
    await add_listener(db, "a")
    await add_listener(db, "b")
    ids = await add_rows(db, ["a", "b", "a", "a", "b"])
    await execute(db, "UPDATE deliveries SET status='dead', dead_reason='retention' WHERE id = $1", ids[2])
    async with httpx.AsyncClient(base_url=pod.base_url, headers=ADMIN) as c:
        everything = (await c.get("/deliveries")).json()
        assert [d["id"] for d in everything["deliveries"]] == ids[::-1]
        assert everything["next_before"] is None
        only_a = (await c.get("/deliveries", params={"listener": "a"})).json()
        assert [d["id"] for d in only_a["deliveries"]] == [ids[3], ids[2], ids[0]]
        dead = (await c.get("/deliveries", params={"status": "dead"})).json()
        assert [(d["id"], d["dead_reason"]) for d in dead["deliveries"]] == [(ids[2], "retention")]
        page1 = (await c.get("/deliveries", params={"limit": 2})).json()
        assert [d["id"] for d in page1["deliveries"]] == [ids[4], ids[3]]
        page2 = (await c.get("/deliveries", params={"limit": 2, "before": page1["next_before"]})).json()
        assert [d["id"] for d in page2["deliveries"]] == [ids[2], ids[1]]
        bad = await c.get("/deliveries", params={"status": "weird"})
        assert bad.status_code == 400 and bad.json()["error"] == "invalid_query"
        assert (await c.get("/deliveries", params={"limit": "0"})).status_code == 400
        assert (await c.get("/deliveries", params={"limit": "x"})).status_code == 400
        nul = await c.get("/deliveries", params={"listener": "a\x00"})  # no name holds NUL
        assert nul.status_code == 200 and nul.json() == {"deliveries": [], "next_before": None}


async def test_get_one_with_attempts_and_404(pod_factory, db):
    pod = await make_pod(pod_factory)
    await add_listener(db, "a")
    [rid] = await add_rows(db, ["a"])
    await execute(
        db,
        "INSERT INTO delivery_attempts (delivery_id, attempt, pod_id, started_at, duration_ms, outcome, status_code,"
        " error, response_body) VALUES ($1, 1, 'p', now(), 3.5, 'http_error', 500, 'HTTP 500', 'oops')", rid,
    )
    async with httpx.AsyncClient(base_url=pod.base_url, headers=ADMIN) as c:
        d = (await c.get(f"/deliveries/{rid}")).json()
        assert d["id"] == rid and d["listener"] == "a" and d["status"] == "pending"
        assert d["attempts"] == [{"attempt": 1, "pod_id": "p", "started_at": d["attempts"][0]["started_at"],
                                  "duration_ms": 3.5, "outcome": "http_error", "status_code": 500,
                                  "error": "HTTP 500", "response_body": "oops"}]
        for missing in ("999999", "abc", "-1", "99999999999999999999999"):
            r = await c.get(f"/deliveries/{missing}")
            assert r.status_code == 404 and r.json()["error"] == "delivery_not_found"


async def test_redeliver_dead_or_delivered_becomes_pending_and_due(pod_factory, db):
    pod = await make_pod(pod_factory)
    await add_listener(db, "a")
    dead, delivered, pending = await add_rows(db, ["a", "a", "a"])
    await execute(db, "UPDATE deliveries SET status='dead', dead_reason='retention', attempts=5,"
                          " due_at = now() + interval '1 hour' WHERE id=$1", dead)
    await execute(db, "UPDATE deliveries SET status='delivered', delivered_at=now(), attempts=1 WHERE id=$1", delivered)
    async with httpx.AsyncClient(base_url=pod.base_url, headers=ADMIN) as c:
        for rid in (dead, delivered):
            r = await c.post(f"/deliveries/{rid}/redeliver")
            assert r.status_code == 202 and r.json() == {"id": rid, "listener": "a", "status": "pending"}
        r = await c.post(f"/deliveries/{pending}/redeliver")
        assert r.status_code == 409 and r.json()["error"] == "delivery_pending"
        assert (await c.post("/deliveries/424242/redeliver")).status_code == 404
    rows = await fetch(db, "SELECT id, status, dead_reason, delivered_at, due_at <= clock_timestamp() AS due,"
                               " attempts FROM deliveries WHERE id = ANY($1) ORDER BY id", [dead, delivered])
    assert [(r["status"], r["dead_reason"], r["delivered_at"], r["due"]) for r in rows] == [("pending", None, None, True)] * 2
    assert [r["attempts"] for r in rows] == [5, 1]  # attempt numbers keep counting


async def test_admin_token_required(pod_factory):
    pod = await make_pod(pod_factory)
    async with httpx.AsyncClient(base_url=pod.base_url) as c:
        for method, path in (("GET", "/deliveries"), ("GET", "/deliveries/1"), ("POST", "/deliveries/1/redeliver")):
            r = await c.request(method, path)
            assert r.status_code == 401 and r.json()["error"] == "unauthorized"
            r = await c.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
