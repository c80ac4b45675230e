"""Delivery targets: the client refuses denied addresses at connect time, after resolving.

The guard lives in the network backend (relay_trio.delivery.http_client), so these tests
go through a real httpx request to a real local socket, with a fake resolver standing in
for a DNS server that answers with a metadata or link-local address.
"""

from __future__ import annotations

import ipaddress

import httpx
import pytest
import trio

from delivery_support import RecordingServer
from relay_trio.config import Settings
from relay_trio.delivery.http_client import GuardedBackend, TargetPolicy, make_http_client


def _redirect_aware(server: RecordingServer):
    """200 everywhere, except /redirect* which answers 302 to /landed on the same server."""

    def respond(path: str, headers: dict, body: bytes):
        if path.startswith("/redirect"):
            return "302 Found", {"Location": f"http://127.0.0.1:{server.port}/landed"}, b"ok"
        return "200 OK", {}, b"ok"

    return respond


@pytest.fixture
async def server(nursery) -> RecordingServer:
    srv = RecordingServer()
    srv.respond = _redirect_aware(srv)
    await srv.start(nursery)
    return srv


def fixed_resolver(mapping: dict[str, list[str]]):
    calls: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return list(mapping[host])

    resolve.calls = calls  # type: ignore[attr-defined]
    return resolve


# ------------------------------------------------------------------------------------------
# The policy
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "address",
    ["169.254.169.254", "169.254.0.1", "fd00:ec2::254", "fe80::1", "::ffff:169.254.169.254"],
)
def test_default_policy_refuses_metadata_and_link_local(address):
    policy = TargetPolicy.from_settings(Settings())
    assert policy.refusal(address) is not None


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "192.168.1.10", "93.184.216.34", "::1", "2606:4700::1"])
def test_default_policy_allows_private_and_public(address):
    """Like Convoy: only metadata/link-local by default, so self-hosted listeners work."""
    policy = TargetPolicy.from_settings(Settings())
    assert policy.refusal(address) is None


def test_allow_list_wins_over_deny_list(monkeypatch):
    monkeypatch.setenv("RELAY_TARGET_DENY_CIDRS", "10.0.0.0/8,169.254.0.0/16")
    monkeypatch.setenv("RELAY_TARGET_ALLOW_CIDRS", "10.9.0.0/16")
    policy = TargetPolicy.from_settings(Settings())
    assert policy.deny == [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("169.254.0.0/16")]
    assert policy.refusal("10.1.2.3") is not None
    assert policy.refusal("10.9.2.3") is None
    assert policy.refusal("169.254.169.254") is not None
    assert policy.refusal("fd00:ec2::254") is None  # the env replaced the default list


# ------------------------------------------------------------------------------------------
# Through a real client and socket
# ------------------------------------------------------------------------------------------
async def test_client_does_not_follow_redirects_and_has_no_timeout(server):
    async with make_http_client(Settings()) as client:
        assert client.timeout == httpx.Timeout(None)
        resp = await client.post(f"http://127.0.0.1:{server.port}/redirect", content=b"{}")
    assert resp.status_code == 302
    assert [r["path"] for r in server.requests] == ["/redirect"]


async def test_denied_resolved_address_is_refused_before_connecting(server):
    settings = Settings(target_deny_cidrs="127.0.0.0/8")
    async with make_http_client(settings) as client:
        with pytest.raises(httpx.ConnectError, match="refused.*127.0.0.0/8"):
            await client.post(f"http://127.0.0.1:{server.port}/hook", content=b"{}")
    assert server.connections == 0


async def test_dns_rebinding_to_metadata_is_refused(server):
    """The URL names an innocent host; DNS answers with the metadata address: refused."""
    resolver = fixed_resolver({"hooks.example.test": ["169.254.169.254"]})
    async with make_http_client(Settings(), resolver=resolver) as client:
        with pytest.raises(httpx.ConnectError, match="169.254.0.0/16"):
            await client.post(f"http://hooks.example.test:{server.port}/hook", content=b"{}")
    assert resolver.calls == ["hooks.example.test"]
    assert server.connections == 0


async def test_connects_to_the_checked_address_not_the_name(server):
    """The name only resolves through our resolver: a second lookup by the OS would fail,
    so a delivery that arrives proves the connect used the address that was checked."""
    resolver = fixed_resolver({"agent.rebind.invalid": ["127.0.0.1"]})
    async with make_http_client(Settings(), resolver=resolver) as client:
        resp = await client.post(f"http://agent.rebind.invalid:{server.port}/hook", content=b"{}")
    assert resp.status_code == 200
    assert server.requests[0]["headers"]["host"] == f"agent.rebind.invalid:{server.port}"


async def test_each_new_connection_is_checked_again(server):
    """First answer allowed, a later answer (rebinding) denied: the later connect is refused."""
    answers = [["127.0.0.1"], ["169.254.169.254"]]

    async def rebinding(host: str, port: int) -> list[str]:
        return answers.pop(0)

    async with make_http_client(Settings(), resolver=rebinding) as c1:
        assert (await c1.get(f"http://flip.invalid:{server.port}/a")).status_code == 200
    async with make_http_client(Settings(), resolver=rebinding) as c2:
        with pytest.raises(httpx.ConnectError, match="refused"):
            await c2.get(f"http://flip.invalid:{server.port}/b")
    assert [r["path"] for r in server.requests] == ["/a"]


async def test_mixed_answer_connects_only_to_permitted_addresses():
    attempted: list[str] = []

    class RecordingBackend:
        async def connect_tcp(self, host, port, **kwargs):
            attempted.append(host)
            raise OSError("no route (test)")

        async def sleep(self, seconds):
            await trio.sleep(seconds)

    resolver = fixed_resolver({"mixed.invalid": ["169.254.169.254", "127.0.0.1", "fd00:ec2::254", "::1"]})
    backend = GuardedBackend(TargetPolicy.from_settings(Settings()), resolver=resolver, inner=RecordingBackend())
    import httpcore

    with pytest.raises(httpcore.ConnectError):
        await backend.connect_tcp("mixed.invalid", 80)
    assert attempted == ["127.0.0.1", "::1"]


async def test_proxy_environment_is_ignored(server, monkeypatch):
    """A proxy would make the guard check the proxy's address instead of the target's."""
    monkeypatch.setenv("HTTP_PROXY", "http://169.254.169.254:3128")
    monkeypatch.setenv("ALL_PROXY", "http://169.254.169.254:3128")
    async with make_http_client(Settings()) as client:
        resp = await client.get(f"http://127.0.0.1:{server.port}/direct")
    assert resp.status_code == 200
    assert server.requests[0]["path"] == "/direct"


# ------------------------------------------------------------------------------------------
# End to end: a pod refuses a denied target and records why
# ------------------------------------------------------------------------------------------
async def test_pod_records_a_refused_target_as_the_attempt_error(pod_factory, db, server):
    """Loopback is denied here (as 169.254.0.0/16 is by default): the row is retried, never
    delivered, the listener sees no connection, and the attempt says why."""
    pod = await pod_factory(target_deny_cidrs="127.0.0.0/8", retry_base=0.2, retry_cap=0.5, poll_min=0.05, poll_max=0.2)
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.put("/listeners/meta", json={"url": f"http://127.0.0.1:{server.port}/hook"})
        assert resp.status_code == 201, resp.text
        await trio.sleep(0.3)  # registry cache
        resp = await client.post("/events", json={"channel": "c", "author": "a", "content": "x", "mentions": ["meta"]})
        assert resp.status_code == 202, resp.text

    async def attempts(conn):
        return await conn.fetch("SELECT outcome, error FROM delivery_attempts ORDER BY id")

    with trio.fail_after(20):
        while len(rows := await db.run(attempts)) < 2:
            await trio.sleep(0.05)
    assert all(r["outcome"] != "delivered" and "refused" in r["error"] and "127.0.0.0/8" in r["error"] for r in rows), rows
    assert server.connections == 0
