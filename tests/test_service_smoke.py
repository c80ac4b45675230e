"""The service skeleton: a pod serves /healthz and /readyz on an ephemeral port."""

import httpx


async def test_pod_serves_health_and_ready(pod_factory):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        health = await client.get("/healthz")
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
        ready = await client.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["problems"] == []


async def test_unknown_route_is_json_404(pod_factory):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.get("/no-such-thing")
    assert resp.status_code == 404
    assert resp.json()["error"] == "not_found"
