"""Pull streams over HTTP (SSE) against a real pod and PostgreSQL.

Events are written with plain SQL plus a NOTIFY on relay_events after commit (what intake
does), so these tests exercise the stream alone. ``stream_poll`` is set far above the
test bounds wherever a test is about wakes, so the safety-net re-read cannot hide a
missing wake.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from contextlib import asynccontextmanager

import httpx
import trio

from relay_trio import channels
from relay_trio.db import connect_dedicated, on_connection

ADMIN = "admin-secret"
SLOW_POLL = 60.0  # the safety net never fires within a test


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def add_listener(db, name: str) -> str:
    """A listener row with a stream token; returns the token."""
    token = f"tok-{name}"

    async def op(conn):
        await conn.execute(
            "INSERT INTO listeners (name, url, secret, stream_token_hash) VALUES ($1, $2, 'whsec_x', $3)",
            name,
            f"http://127.0.0.1:9/{name}",
            hashlib.sha256(token.encode()).hexdigest(),
        )

    await db.run(op)
    return token


async def insert_event_sql(conn, event_id: str, mentions: list[str]) -> int:
    return await conn.fetchval(
        "INSERT INTO events (id, channel, author, content, mentions, body_hash)"
        " VALUES ($1, 'general', 'tester', 'hello ' || $1, $2, 'h') RETURNING seq",
        event_id,
        mentions,
    )


async def publish(db, event_id: str, mentions: list[str]) -> int:
    """Insert one event, commit, then NOTIFY relay_events (as intake does)."""
    seq = await db.run_tx(insert_event_sql, event_id, mentions)
    await db.run(lambda conn: conn.execute("SELECT pg_notify($1, $2)", channels.EVENTS, str(seq)))
    return seq


class SseClient:
    """Reads SSE blocks from an httpx streaming response in a background task.

    (Cancelling a read of ``aiter_lines`` mid-way would finish that generator, so reads
    with a deadline take from a channel the pump fills instead.)
    """

    def __init__(self, response: httpx.Response):
        self.response = response
        self.comments: list[str] = []
        self.ended = False
        self._send, self._recv = trio.open_memory_channel[dict | None](1000)

    async def pump(self) -> None:
        fields: dict[str, str] = {}
        async for line in self.response.aiter_lines():
            if line == "":
                if "data" in fields:
                    data = json.loads(fields["data"])
                    assert fields["id"] == str(data["seq"])
                    self._send.send_nowait(data)
                fields = {}
            elif line.startswith(":"):
                self.comments.append(line[1:].strip())
            else:
                key, _, value = line.partition(":")
                fields[key] = value[1:] if value.startswith(" ") else value
        self.ended = True
        self._send.send_nowait(None)

    async def next_or_end(self, timeout: float = 10.0) -> dict | None:
        with trio.fail_after(timeout):
            return await self._recv.receive()

    async def next_event(self, timeout: float = 10.0) -> dict:
        event = await self.next_or_end(timeout)
        assert event is not None, "stream ended"
        return event

    async def events(self, n: int, timeout: float = 10.0) -> list[dict]:
        return [await self.next_event(timeout) for _ in range(n)]

    async def nothing_within(self, seconds: float) -> bool:
        with trio.move_on_after(seconds):
            await self._recv.receive()
            return False
        return True


@asynccontextmanager
async def open_sse(client: httpx.AsyncClient, path: str, **kwargs):
    async with client.stream("GET", path, **kwargs) as resp:
        reader = SseClient(resp)
        async with trio.open_nursery() as nursery:
            if resp.status_code == 200:
                nursery.start_soon(reader.pump)
            yield reader
            nursery.cancel_scope.cancel()


async def test_stream_in_order_live_and_resume_with_last_event_id(pod_factory, db):
    pod = await pod_factory(admin_token=ADMIN, stream_poll=SLOW_POLL)
    token = await add_listener(db, "alpha")
    s1 = await publish(db, "e1", ["alpha"])
    await publish(db, "other", ["beta"])
    s2 = await publish(db, "e2", ["alpha", "beta"])

    async with httpx.AsyncClient(base_url=pod.base_url, timeout=30) as client:
        async with open_sse(client, "/listeners/alpha/stream", headers=auth(token)) as sse:
            assert sse.response.status_code == 200
            assert sse.response.headers["content-type"].startswith("text/event-stream")
            first = await sse.events(2)
            assert [e["seq"] for e in first] == [s1, s2]
            assert first[0]["id"] == "e1" and first[0]["content"] == "hello e1"
            # Live: woken by the NOTIFY (the periodic re-read is 60 s away).
            s3 = await publish(db, "e3", ["alpha"])
            assert (await sse.next_event())["seq"] == s3

        # Disconnected: two more arrive meanwhile.
        s4 = await publish(db, "e4", ["alpha"])
        s5 = await publish(db, "e5", ["alpha"])
        headers = {**auth(token), "Last-Event-ID": str(s3)}
        async with open_sse(client, "/listeners/alpha/stream", headers=headers) as sse:
            assert [e["seq"] for e in await sse.events(2)] == [s4, s5]  # no gap, no repeat
            s6 = await publish(db, "e6", ["alpha"])
            assert (await sse.next_event())["seq"] == s6


async def test_start_position_after_param_then_saved_offset(pod_factory, db):
    pod = await pod_factory(admin_token=ADMIN, stream_poll=SLOW_POLL)
    await add_listener(db, "alpha")
    seqs = [await publish(db, f"e{i}", ["alpha"]) for i in range(4)]
    async with httpx.AsyncClient(base_url=pod.base_url, timeout=30, headers=auth(ADMIN)) as client:
        resp = await client.put("/listeners/alpha/offset", json={"seq": seqs[1]})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"listener": "alpha", "seq": seqs[1]}
        assert (await client.get("/listeners/alpha/offset")).json()["seq"] == seqs[1]
        # No cursor given: after the saved offset.
        async with open_sse(client, "/listeners/alpha/stream") as sse:
            assert (await sse.next_event())["seq"] == seqs[2]
        # Last-Event-ID wins over the saved offset; ?after= wins over both.
        headers = {"Last-Event-ID": str(seqs[2])}
        async with open_sse(client, "/listeners/alpha/stream", headers=headers) as sse:
            assert (await sse.next_event())["seq"] == seqs[3]
        async with open_sse(client, "/listeners/alpha/stream", params={"after": 0}, headers=headers) as sse:
            assert (await sse.next_event())["seq"] == seqs[0]
        for after in ("x", "-1", str(2**63)):
            bad = await client.get("/listeners/alpha/stream", params={"after": after})
            assert bad.status_code == 400 and bad.json()["error"] == "invalid_cursor", after
        bad = await client.get("/listeners/alpha/stream", headers={"Last-Event-ID": "nope"})
        assert bad.status_code == 400


async def test_offset_is_monotonic_over_http(pod_factory, db):
    pod = await pod_factory(admin_token=ADMIN)
    token = await add_listener(db, "alpha")
    async with httpx.AsyncClient(base_url=pod.base_url, headers=auth(token)) as client:
        assert (await client.put("/listeners/alpha/offset", json={"seq": 10})).status_code == 200
        assert (await client.put("/listeners/alpha/offset", json={"seq": 10})).status_code == 200
        lower = await client.put("/listeners/alpha/offset", json={"seq": 9})
        assert lower.status_code == 409
        assert lower.json()["error"] == "offset_regression"
        assert lower.json()["detail"]["current"] == 10
        for body in ({"seq": -1}, {"seq": "11"}, {"seq": True}, {"seq": 2**63}, {"seq": 1.5}, {}, [1]):
            resp = await client.put("/listeners/alpha/offset", json=body)
            assert resp.status_code == 400, body
        text = await client.put("/listeners/alpha/offset", content=b"12", headers={"content-type": "text/plain"})
        assert text.status_code == 415
        assert (await client.get("/listeners/alpha/offset")).json()["seq"] == 10


async def test_stream_auth_admin_or_own_token_only(pod_factory, db):
    pod = await pod_factory(admin_token=ADMIN)
    alpha = await add_listener(db, "alpha")
    # (client read timeout 5 s: a stream wrongly opened by a plain GET fails fast, not by hanging)
    beta = await add_listener(db, "beta")
    await publish(db, "e1", ["alpha"])
    async with httpx.AsyncClient(base_url=pod.base_url, timeout=5) as client:
        assert (await client.get("/listeners/alpha/stream")).status_code == 401
        wrong = await client.get("/listeners/alpha/stream", headers=auth(beta))  # beta's token, alpha's stream
        assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
        assert (await client.put("/listeners/alpha/offset", json={"seq": 1}, headers=auth(beta))).status_code == 401
        assert (await client.get("/listeners/nobody/stream", headers=auth(alpha))).status_code == 401
        assert (await client.get("/listeners/nobody/stream", headers=auth(ADMIN))).status_code == 404
        # A name no listener can have (here with NUL) is never sent to PostgreSQL: no 500.
        assert (await client.get("/listeners/a%00b/stream", headers=auth(alpha))).status_code == 401
        assert (await client.get("/listeners/a%00b/stream", headers=auth(ADMIN))).status_code == 404
        assert (await client.put("/listeners/a%00b/offset", json={"seq": 1}, headers=auth(ADMIN))).status_code == 404
        for token in (alpha, ADMIN):
            async with open_sse(client, "/listeners/alpha/stream", headers=auth(token)) as sse:
                assert sse.response.status_code == 200
                assert (await sse.next_event())["id"] == "e1"


async def test_lower_seq_committing_last_is_streamed_in_order(pod_factory, db):
    pod = await pod_factory(admin_token=ADMIN, stream_poll=SLOW_POLL)
    token = await add_listener(db, "alpha")
    first = await connect_dedicated(db.dsn, "test-writer-1")
    second = await connect_dedicated(db.dsn, "test-writer-2")

    async def begin_and_insert(conn, event_id):
        await conn.execute("BEGIN")
        return await insert_event_sql(conn, event_id, ["alpha"])

    async def commit_and_notify(conn, seq):
        await conn.execute("COMMIT")
        await conn.execute("SELECT pg_notify($1, $2)", channels.EVENTS, str(seq))

    try:
        async with httpx.AsyncClient(base_url=pod.base_url, timeout=30) as client:
            async with open_sse(client, "/listeners/alpha/stream", headers=auth(token)) as sse:
                low = await on_connection(first, begin_and_insert, "low")
                high = await on_connection(second, begin_and_insert, "high")
                assert low < high
                await on_connection(second, commit_and_notify, high)
                # The wake came, but the lower seq is still in flight: nothing may be sent.
                assert await sse.nothing_within(1.0)
                await on_connection(first, commit_and_notify, low)
                assert [e["seq"] for e in await sse.events(2)] == [low, high]
    finally:
        with trio.CancelScope(shield=True):
            for conn in (first, second):
                await on_connection(conn, lambda c: c.close())


async def wait_until(predicate, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


def open_streams(pod) -> float:
    return pod.metrics.streams_open._value.get()


def event_subscribers(pod) -> int:
    return len(pod.pglistener._subs.get(channels.EVENTS, ()))


async def test_client_disconnect_releases_the_stream(pod_factory, db):
    pod = await pod_factory(admin_token=ADMIN, stream_poll=SLOW_POLL, stream_heartbeat=SLOW_POLL)
    token = await add_listener(db, "alpha")
    await publish(db, "e1", ["alpha"])
    async with httpx.AsyncClient(base_url=pod.base_url, timeout=30) as client:
        async with open_sse(client, "/listeners/alpha/stream", headers=auth(token)) as sse:
            await sse.next_event()
            assert open_streams(pod) == 1
            assert event_subscribers(pod) == 1
    # The client went away while the stream was idle (waiting for a wake).
    await wait_until(lambda: open_streams(pod) == 0 and event_subscribers(pod) == 0)


async def test_heartbeat_comments_on_idle_stream(pod_factory, db):
    pod = await pod_factory(admin_token=ADMIN, stream_poll=SLOW_POLL, stream_heartbeat=0.2)
    token = await add_listener(db, "alpha")
    async with httpx.AsyncClient(base_url=pod.base_url, timeout=30) as client:
        async with open_sse(client, "/listeners/alpha/stream", headers=auth(token)) as sse:
            with trio.fail_after(10):
                while sse.comments.count("ping") < 2:
                    await trio.sleep(0.05)


async def test_graceful_shutdown_ends_open_streams(pod_factory, db):
    # The HTTP drain would wait db_timeout + 1 = 11 s for a stream that ignores shutdown,
    # then cut it (an incomplete chunked body); a stream that honours it ends cleanly.
    pod = await pod_factory(admin_token=ADMIN, stream_poll=SLOW_POLL, stream_heartbeat=SLOW_POLL,
                            shutdown_grace=30.0, db_timeout=10.0)
    token = await add_listener(db, "alpha")
    await publish(db, "e1", ["alpha"])
    async with httpx.AsyncClient(base_url=pod.base_url, timeout=30) as client:
        async with open_sse(client, "/listeners/alpha/stream", headers=auth(token)) as sse:
            await sse.next_event()
            await trio.sleep(0.5)  # let the stream go idle (its first wake is consumed at once)
            pod.shutting_down.set()
            with trio.fail_after(8):
                assert await sse.next_or_end() is None  # clean end of the body, no error
    assert open_streams(pod) == 0


async def test_stream_keeps_receiving_across_a_listener_backend_kill(pod_factory, db):
    pod = await pod_factory(admin_token=ADMIN, stream_poll=SLOW_POLL, stream_heartbeat=SLOW_POLL)
    token = await add_listener(db, "alpha")

    async def kill_listener_backend(conn):
        return await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name LIKE 'relay-listener:%'"
        )

    async with httpx.AsyncClient(base_url=pod.base_url, timeout=30) as client:
        async with open_sse(client, "/listeners/alpha/stream", headers=auth(token)) as sse:
            s1 = await publish(db, "e1", ["alpha"])
            assert (await sse.next_event())["seq"] == s1
            assert await db.run(kill_listener_backend) == 1
            # Written (and notified) while the listener is down or reconnecting: the NOTIFY
            # may be lost, the wake-all after the reconnect must make the stream re-read.
            s2 = await publish(db, "e2", ["alpha"])
            assert (await sse.next_event(timeout=20))["seq"] == s2
            await wait_until(lambda: pod.pglistener.status()["reconnects"] >= 1, timeout=20)
            s3 = await publish(db, "e3", ["alpha"])
            assert (await sse.next_event())["seq"] == s3


async def test_end_to_end_post_events_then_stream_and_resume(pod_factory):
    """The README's curl walk-through: create a listener, stream it, POST events, resume."""
    pod = await pod_factory(admin_token=ADMIN, ingest_tokens="ingest-secret", stream_poll=SLOW_POLL)
    async with httpx.AsyncClient(base_url=pod.base_url, timeout=30) as client:
        created = await client.put("/listeners/alpha", json={"url": "http://127.0.0.1:9/hook"}, headers=auth(ADMIN))
        assert created.status_code == 201, created.text
        token = created.json()["stream_token"]

        async def post(event_id: str) -> int:
            body = {"id": event_id, "channel": "general", "author": "alice", "content": "hi", "mentions": ["alpha"]}
            resp = await client.post("/events", json=body, headers=auth("ingest-secret"))
            assert resp.status_code in (200, 201, 202), resp.text
            return resp.json()["seq"]

        async with open_sse(client, "/listeners/alpha/stream", headers=auth(token)) as sse:
            s1 = await post("evt-1")
            got = await sse.next_event()  # live: intake's NOTIFY woke the stream
            assert (got["seq"], got["id"], got["mentions"]) == (s1, "evt-1", ["alpha"])
        s2 = await post("evt-2")
        async with open_sse(client, "/listeners/alpha/stream", headers={**auth(token), "Last-Event-ID": str(s1)}) as sse:
            assert (await sse.next_event())["seq"] == s2


async def test_stream_reads_use_at_most_half_the_pool(pod_factory, db):
    """A wake reaches every stream at once; their reads must not take the whole pool."""
    from relay_trio.store.offsets import read_stream

    pod = await pod_factory(admin_token=ADMIN, stream_poll=SLOW_POLL, pool_max_size=4)
    token = await add_listener(db, "alpha")
    running = 0
    peak = 0
    original = pod.db.run

    async def counting_run(op, *args, **kwargs):
        nonlocal running, peak
        if op is not read_stream:
            return await original(op, *args, **kwargs)
        running += 1
        peak = max(peak, running)
        try:
            await trio.sleep(0.05)  # hold the slot long enough for the others to pile up
            return await original(op, *args, **kwargs)
        finally:
            running -= 1

    pod.db.run = counting_run
    async with httpx.AsyncClient(base_url=pod.base_url, timeout=30) as client:
        async with contextlib.AsyncExitStack() as stack:
            streams = [
                await stack.enter_async_context(open_sse(client, "/listeners/alpha/stream", headers=auth(token)))
                for _ in range(6)
            ]
            seq = await publish(db, "e1", ["alpha"])
            for sse in streams:
                assert (await sse.next_event())["seq"] == seq
    assert 1 <= peak <= 2


async def test_event_posted_on_one_pod_wakes_a_stream_on_another(pod_factory):
    settings = dict(admin_token=ADMIN, ingest_tokens="ingest-secret", stream_poll=SLOW_POLL)
    writer, reader = await pod_factory(**settings), await pod_factory(**settings)
    async with httpx.AsyncClient(timeout=30) as client:
        created = await client.put(f"{writer.base_url}/listeners/alpha", json={"url": "http://127.0.0.1:9/hook"},
                                   headers=auth(ADMIN))
        token = created.json()["stream_token"]
        async with open_sse(client, f"{reader.base_url}/listeners/alpha/stream", headers=auth(token)) as sse:
            await trio.sleep(0.2)  # the stream is idle, waiting for a wake
            body = {"id": "evt-x", "channel": "general", "author": "alice", "content": "hi", "mentions": ["alpha"]}
            posted = await client.post(f"{writer.base_url}/events", json=body, headers=auth("ingest-secret"))
            assert (await sse.next_event())["seq"] == posted.json()["seq"]  # the writer's NOTIFY, not a poll
