"""POST /events over HTTP: validation (400 naming the field), 413, 415, replay and 409,
and idempotency under concurrent duplicates. A bad request changes nothing."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from intake_helpers import fetchval
from relay_trio.intake import ValidationFailed, parse_event

OK = {"channel": "general", "author": "alice", "content": "hi @bot", "mentions": ["bot"], "meta": {"k": 1}}


def with_(**changes):
    body = dict(OK)
    for k, v in changes.items():
        if v is _DROP:
            body.pop(k)
        else:
            body[k] = v
    return body


_DROP = object()

# (case, body, error code, field)
BAD_BODIES = [
    ("unknown field", with_(extra=1), "unknown_field", "extra"),
    ("missing channel", with_(channel=_DROP), "missing_field", "channel"),
    ("missing author", with_(author=_DROP), "missing_field", "author"),
    ("missing content", with_(content=_DROP), "missing_field", "content"),
    ("id wrong type", with_(id=5), "invalid_field", "id"),
    ("id empty", with_(id=""), "invalid_field", "id"),
    ("id bad chars", with_(id="evt/1"), "invalid_field", "id"),
    ("id too long", with_(id="e" * 129), "invalid_field", "id"),
    ("channel wrong type", with_(channel=["g"]), "invalid_field", "channel"),
    ("channel empty", with_(channel=""), "invalid_field", "channel"),
    ("channel too long", with_(channel="c" * 129), "invalid_field", "channel"),
    ("channel null", with_(channel=None), "invalid_field", "channel"),
    ("author wrong type", with_(author=1), "invalid_field", "author"),
    ("author empty", with_(author=""), "invalid_field", "author"),
    ("author too long", with_(author="a" * 129), "invalid_field", "author"),
    ("content wrong type", with_(content={"t": 1}), "invalid_field", "content"),
    ("content empty", with_(content=""), "invalid_field", "content"),
    ("content over 64 KiB of UTF-8", with_(content="é" * 32769), "invalid_field", "content"),
    ("content NUL", with_(content="a\x00b"), "invalid_field", "content"),
    ("mentions wrong type", with_(mentions="bot"), "invalid_field", "mentions"),
    ("mentions item wrong type", with_(mentions=[1]), "invalid_field", "mentions"),
    ("mentions item empty", with_(mentions=[""]), "invalid_field", "mentions"),
    ("mentions item bad chars", with_(mentions=["b o t"]), "invalid_field", "mentions"),
    ("mentions over 100", with_(mentions=[f"l{i}" for i in range(101)]), "invalid_field", "mentions"),
    ("meta wrong type", with_(meta=[1]), "invalid_field", "meta"),
    ("meta over 16 KiB", with_(meta={"x": "y" * 16384}), "invalid_field", "meta"),
    ("meta NUL", with_(meta={"x": "\x00"}), "invalid_field", "meta"),
    ("meta too deep", with_(meta=json.loads('{"a":' * 40 + "1" + "}" * 40)), "invalid_field", "meta"),
]

RAW_BAD = [
    ("not JSON", b"{nope", "invalid_json"),
    ("NaN", b'{"channel": "g", "author": "a", "content": "c", "meta": {"x": NaN}}', "invalid_json"),
    ("invalid UTF-8", b'{"channel": "\xff"}', "invalid_json"),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
    ("not an object", b"[1, 2]", "invalid_body"),
    ("overflowing float", b'{"channel": "g", "author": "a", "content": "c", "meta": {"x": [1e400]}}', "invalid_*"),
    ("lone surrogate", b'{"channel": "g", "author": "a", "content": "\\ud800"}', "invalid_field"),
]


async def count_events(db) -> int:
    return await fetchval(db, "SELECT count(*) FROM events")


async def test_every_validation_rule_is_a_400_naming_the_field(pod_factory, db):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        for case, body, code, field in BAD_BODIES:
            resp = await client.post("/events", json=body)
            assert resp.status_code == 400, (case, resp.text)
            data = resp.json()
            assert data["error"] == code, (case, data)
            assert data["detail"]["field"] == field, (case, data)
        for case, raw, code in RAW_BAD:
            resp = await client.post("/events", content=raw, headers={"Content-Type": "application/json"})
            assert resp.status_code == 400, (case, resp.text)
            if code == "invalid_*":  # refused by the JSON reader or by parse_event: either is fine
                assert resp.json()["error"] in ("invalid_json", "invalid_field"), (case, resp.text)
            else:
                assert resp.json()["error"] == code, (case, resp.text)
    assert await count_events(db) == 0
    assert pod.metrics.registry.get_sample_value("relay_events_rejected_total", {"reason": "invalid_field"}) > 0


def test_non_finite_numbers_in_meta_are_refused_before_postgres():
    # jsonb has no Infinity/NaN: they would fail inside the transaction (a 500).
    for value in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValidationFailed) as info:
            parse_event({**OK, "meta": {"deep": [{"x": value}]}})
        assert info.value.field == "meta"


async def test_limits_are_inclusive(pod_factory):
    pod = await pod_factory()
    body = with_(
        id="e" * 128, channel="c" * 128, author="a" * 128, content="é" * 32768,
        mentions=[f"l{i}" for i in range(100)], meta={"x": "y" * (16384 - 8)},
    )
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.post("/events", json=body)
    assert resp.status_code == 202, resp.text
    assert len(resp.json()["unrouted"]) == 100


async def test_non_json_content_type_is_415(pod_factory):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
            resp = await client.post("/events", content=json.dumps(OK).encode(), headers=headers)
            assert resp.status_code == 415, (headers, resp.text)
            assert resp.json()["error"] == "unsupported_media_type"
        resp = await client.post(
            "/events", content=json.dumps(OK).encode(), headers={"Content-Type": "application/json; charset=utf-8"}
        )
        assert resp.status_code == 202, resp.text


async def test_bodies_over_256_kib_are_json_413_also_when_chunked(pod_factory, db):
    pod = await pod_factory()
    big = json.dumps(with_(content="x" * (256 * 1024))).encode()

    async def chunked():
        for i in range(0, len(big), 16384):
            yield big[i : i + 16384]

    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.post("/events", content=big, headers={"Content-Type": "application/json"})
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"] == "payload_too_large"
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.post("/events", content=chunked(), headers={"Content-Type": "application/json"})
        assert "content-length" not in resp.request.headers
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"] == "payload_too_large"
    assert await count_events(db) == 0


async def test_generated_id_and_202_shape(pod_factory):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        a = (await client.post("/events", json=OK)).json()
        b = (await client.post("/events", json=OK)).json()
    assert set(a) == {"id", "seq", "accepted_at", "deliveries", "unrouted"}
    assert a["id"] != b["id"] and b["seq"] > a["seq"]
    assert a["unrouted"] == ["bot"] and a["deliveries"] == []


async def test_same_id_same_body_replays_the_original_response(pod_factory, db):
    pod = await pod_factory()
    body = with_(id="evt-1")
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        await client.put("/listeners/bot", json={"url": "http://127.0.0.1:9/hook"})
        first = await client.post("/events", json=body)
        # Same body, key order and duplicate mentions differ: still the same body.
        again = await client.post("/events", json={**dict(reversed(list(body.items()))), "mentions": ["bot", "bot"]})
    assert first.status_code == 202
    assert again.status_code == 200
    assert again.json() == first.json()
    assert await count_events(db) == 1
    assert await fetchval(db, "SELECT count(*) FROM deliveries") == 1


async def test_same_id_different_body_is_409_and_changes_nothing(pod_factory, db):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        first = await client.post("/events", json=with_(id="evt-1"))
        other = await client.post("/events", json=with_(id="evt-1", content="something else"))
    assert first.status_code == 202
    assert other.status_code == 409
    assert other.json()["error"] == "id_conflict"
    assert await fetchval(db, "SELECT content FROM events WHERE id = 'evt-1'") == OK["content"]


async def test_twenty_concurrent_duplicates_make_one_event_and_one_set_of_rows(pod_factory, db):
    pod = await pod_factory()
    body = with_(id="evt-race", mentions=["bot", "helper"])
    responses = []
    async with httpx.AsyncClient(base_url=pod.base_url, timeout=30) as client:
        for name in ("bot", "helper"):
            await client.put(f"/listeners/{name}", json={"url": "http://127.0.0.1:9/hook"})

        async def post():
            responses.append(await client.post("/events", json=body))

        async with trio.open_nursery() as n:
            for _ in range(20):
                n.start_soon(post)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 19 + [202], [r.text for r in responses if r.status_code not in (200, 202)]
    assert len({json.dumps(r.json(), sort_keys=True) for r in responses}) == 1
    assert await count_events(db) == 1
    rows = await fetchval(db, "SELECT array_agg(listener ORDER BY listener) FROM deliveries")
    assert rows == ["bot", "helper"]
