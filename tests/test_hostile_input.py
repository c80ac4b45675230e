"""Hostile and malformed input against a live pod process.

Every response to a bad request is a 4xx with a JSON error (never a 5xx, never a hang), a
rejected request leaves the database exactly as it was, the pod's memory stays steady
under oversized bodies, every guarded route refuses missing/malformed/wrong tokens, and
no token, secret or event body ever reaches the log.

The pod is one ``relay-trio serve`` process per module (proc_helpers.PodProcess); the
tests are plain (sync) functions so hypothesis can run many examples against it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
import uuid
from pathlib import Path

import asyncpg
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proc_helpers import PodProcess

INGEST_TOKENS = ("ingest-tok-A1b2C3", "ingest-tok-Z9y8X7")
ADMIN_TOKEN = "admin-tok-Q5w6E7r8"
WRONG_TOKEN_CANARY = "wrong-tok-canary-5150"
CONTENT_CANARY = "body-canary-8c1d"

HYPO = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)


# ------------------------------------------------------------------------------------------
# Fixtures: one pod process and one database connection for the module
# ------------------------------------------------------------------------------------------
class Sql:
    """A blocking view of the test database (its own asyncio loop, one connection)."""

    def __init__(self, dsn: str):
        self.runner = asyncio.Runner()
        self.conn: asyncpg.Connection = self.runner.run(asyncpg.connect(dsn))

    def val(self, query: str, *args):
        return self.runner.run(self.conn.fetchval(query, *args))

    def state(self) -> tuple:
        """Everything a request could have written, in one comparable value."""
        row = self.runner.run(
            self.conn.fetchrow(
                """SELECT (SELECT count(*) FROM events),
                          (SELECT count(*) FROM deliveries),
                          (SELECT md5(coalesce(string_agg(name || url || enabled::text || secret, ',' ORDER BY name), ''))
                             FROM listeners),
                          (SELECT count(*) FROM consumer_offsets)"""
            )
        )
        return tuple(row.values())

    def close(self) -> None:
        self.runner.run(self.conn.close())
        self.runner.close()


@pytest.fixture(scope="module")
def hostile(pg_server, template_db, tmp_path_factory):
    name = f"relay_hi_{uuid.uuid4().hex[:12]}"
    dsn = pg_server.create_database(name, template=template_db)
    log = Path(tmp_path_factory.mktemp("hostile")) / "pod.log"
    pod = PodProcess(dsn, log, ingest_tokens=",".join(INGEST_TOKENS), admin_token=ADMIN_TOKEN).start()
    sql = Sql(dsn)
    client = httpx.Client(timeout=30)
    try:
        pod.wait_ready()
        resp = client.put(
            f"{pod.base_url}/listeners/bot", json={"url": "http://127.0.0.1:9/hook"}, headers=admin()
        )
        assert resp.status_code == 201, resp.text
        pod.secrets = [resp.json()["secret"], resp.json()["stream_token"]]
        yield pod, sql, client
    finally:
        client.close()
        sql.close()
        pod.stop()
        pg_server.drop_database(name)


def ingest(i: int = 0) -> dict[str, str]:
    return {"Authorization": f"Bearer {INGEST_TOKENS[i]}"}


def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def assert_json_error(resp: httpx.Response, *statuses: int) -> dict:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    if statuses:
        assert resp.status_code in statuses, (resp.status_code, resp.text[:500])
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert isinstance(body.get("error"), str) and body["error"], body
    assert "Traceback" not in resp.text
    return body


def post_raw(client, pod, content: bytes, *, headers=None, content_type="application/json") -> httpx.Response:
    h = {"Content-Type": content_type, **ingest(), **(headers or {})}
    return client.post(f"{pod.base_url}/events", content=content, headers=h)


def valid_event(**fields) -> dict:
    body = {"channel": "general", "author": "alice", "content": "hi @bot", "mentions": ["bot"]}
    body.update(fields)
    return body


# ------------------------------------------------------------------------------------------
# Property-based: arbitrary bodies
# ------------------------------------------------------------------------------------------
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)
EVENT_FIELDS = ["id", "channel", "author", "content", "mentions", "meta", "extra", "\x00", ""]


@st.composite
def event_bodies(draw):
    """Mostly-valid bodies with one or more fields replaced by anything (or removed)."""
    body = valid_event(id=f"h-{draw(st.uuids()).hex}")
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(EVENT_FIELDS))
        action = draw(st.sampled_from(["replace", "delete", "text"]))
        if action == "delete":
            body.pop(field, None)
        elif action == "text":
            body[field] = draw(st.text(max_size=200))
        else:
            body[field] = draw(json_values)
    return draw(st.sampled_from([body, body, [body], draw(json_values)]))


def _check_event_response(resp: httpx.Response, before: tuple, after: tuple) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code == 202:
        assert after[0] == before[0] + 1
        body = resp.json()
        assert isinstance(body["seq"], int)
    elif resp.status_code == 200:
        assert after == before  # idempotent replay stores nothing
    else:
        assert_json_error(resp)
        assert after == before, "a rejected request changed the database"


@HYPO
@given(body=event_bodies())
def test_post_events_any_json_body_is_2xx_or_json_4xx_and_rejections_store_nothing(hostile, body):
    pod, sql, client = hostile
    before = sql.state()
    resp = client.post(f"{pod.base_url}/events", json=body, headers=ingest())
    _check_event_response(resp, before, sql.state())


@HYPO
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_post_events_any_bytes_are_4xx_json(hostile, raw):
    pod, sql, client = hostile
    before = sql.state()
    resp = post_raw(client, pod, raw)
    _check_event_response(resp, before, sql.state())


listener_names = st.one_of(
    st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True),
    st.text(min_size=1, max_size=140),
)
urls = st.one_of(
    st.sampled_from(["http://127.0.0.1:9/x", "https://agent.example/hook", "ftp://x/y", "http://", "/relative",
                     "http://[::1", "http://a:99999/", "http://a b/", "javascript:alert(1)", "http://\u00e9.example/"]),
    st.text(max_size=80),
    json_values,
)


@st.composite
def listener_bodies(draw):
    body: dict = {}
    if draw(st.booleans()):
        body["url"] = draw(urls)
    if draw(st.booleans()):
        body["secret"] = draw(st.sampled_from(["whsec_", "whsec_!!!!", "whsec_" + "A" * 24, "nope"]) | json_values)
    if draw(st.booleans()):
        body["enabled"] = draw(json_values)
    if draw(st.integers(0, 4)) == 0:
        body[draw(st.text(max_size=10))] = draw(json_values)
    return draw(st.sampled_from([body, body, body, draw(json_values)]))


@HYPO
@given(name=listener_names, body=listener_bodies())
def test_put_listeners_any_body_is_2xx_or_json_4xx_and_rejections_store_nothing(hostile, name, body):
    pod, sql, client = hostile
    before = sql.state()
    resp = client.put(f"{pod.base_url}/listeners/{urllib.parse.quote(name, safe='')}", json=body, headers=admin())
    after = sql.state()
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code in (200, 201):
        assert resp.json()["name"] == name
    else:
        assert_json_error(resp)
        assert after == before, "a rejected PUT /listeners changed the database"


# ------------------------------------------------------------------------------------------
# Named hostile bodies
# ------------------------------------------------------------------------------------------
HOSTILE_EVENT_BODIES = {
    "invalid_utf8": b'{"channel": "g", "author": "\xff\xfe", "content": "x"}',
    "invalid_utf8_in_key": b'{"chan\xc3\x28nel": "g", "author": "a", "content": "x"}',
    "lone_surrogate": b'{"channel": "g", "author": "a", "content": "\\ud800"}',
    "deeply_nested_array": b"[" * 100_000 + b"]" * 100_000,
    "deeply_nested_meta": (
        b'{"channel": "g", "author": "a", "content": "x", "meta": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}"
    ),
    "meta_nested_past_limit": json.dumps(
        valid_event(meta=json.loads('{"a": ' * 40 + "1" + "}" * 40))
    ).encode(),
    "nul_in_content": json.dumps(valid_event(content="a\x00b")).encode(),
    "nul_in_channel": json.dumps(valid_event(channel="\x00")).encode(),
    "nul_in_meta_value": json.dumps(valid_event(meta={"k": "v\x00"})).encode(),
    "nul_in_meta_key": json.dumps(valid_event(meta={"k\x00": "v"})).encode(),
    "nul_in_mention": json.dumps(valid_event(mentions=["bo\x00t"])).encode(),
    "nul_in_id": json.dumps(valid_event(id="a\x00b")).encode(),
    "number_for_channel": json.dumps(valid_event(channel=5)).encode(),
    "bool_for_author": json.dumps(valid_event(author=True)).encode(),
    "list_for_content": json.dumps(valid_event(content=["x"])).encode(),
    "string_for_mentions": json.dumps(valid_event(mentions="bot")).encode(),
    "number_in_mentions": json.dumps(valid_event(mentions=[1])).encode(),
    "list_for_meta": json.dumps(valid_event(meta=[1])).encode(),
    "null_content": json.dumps(valid_event(content=None)).encode(),
    "number_for_id": json.dumps(valid_event(id=12)).encode(),
    "overflowing_float_in_meta": b'{"channel": "g", "author": "a", "content": "x", "meta": {"x": 1e400}}',
    "nan_literal": b'{"channel": "g", "author": "a", "content": "x", "meta": {"x": NaN}}',
    "101_mentions": json.dumps(valid_event(mentions=[f"m{i}" for i in range(101)])).encode(),
    "100000_mentions": json.dumps(valid_event(mentions=["bot"] * 100_000)).encode(),
    "100000_distinct_mentions_compact": json.dumps(
        valid_event(mentions=[format(i, "x") for i in range(100_000)]), separators=(",", ":")
    ).encode(),
    "content_over_64k": json.dumps(valid_event(content="\u00e9" * 40_000)).encode(),
    "meta_over_16k": json.dumps(valid_event(meta={"k": "v" * 17_000})).encode(),
    "unknown_field": json.dumps(valid_event(admin=True)).encode(),
    "empty_body": b"",
    "json_null": b"null",
    "trailing_garbage": json.dumps(valid_event()).encode() + b"}}",
    "duplicate_keys_bad_last": b'{"channel": "g", "author": "a", "content": "x", "content": 7}',
}


@pytest.mark.parametrize("case", sorted(HOSTILE_EVENT_BODIES))
def test_hostile_event_bodies_are_4xx_json_and_store_nothing(hostile, case):
    pod, sql, client = hostile
    before = sql.state()
    resp = post_raw(client, pod, HOSTILE_EVENT_BODIES[case])
    assert_json_error(resp, 400, 413)
    assert sql.state() == before


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""]
)
def test_non_json_content_type_is_415(hostile, content_type):
    pod, sql, client = hostile
    before = sql.state()
    resp = post_raw(client, pod, json.dumps(valid_event()).encode(), content_type=content_type)
    assert_json_error(resp, 415)
    assert sql.state() == before


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_10mb_bodies_are_413_and_memory_stays_steady(hostile):
    pod, sql, client = hostile
    before = sql.state()
    big = b'{"channel": "g", "author": "a", "content": "' + b"x" * (10 * 1024 * 1024) + b'"}'

    def chunks():
        for i in range(0, len(big), 256 * 1024):
            yield big[i : i + 256 * 1024]

    # warm up once so lazily allocated buffers are in the baseline
    post_raw(client, pod, big)
    rss0 = _rss_kib(pod.pid)
    for i in range(8):
        if i % 2 == 0:
            resp = post_raw(client, pod, big)  # with Content-Length
        else:
            resp = client.post(  # chunked: no Content-Length, the limit applies while streaming
                f"{pod.base_url}/events", content=chunks(), headers={"Content-Type": "application/json", **ingest()}
            )
        assert_json_error(resp, 413)
    rss1 = _rss_kib(pod.pid)
    assert sql.state() == before
    # 80 MB went at the pod; it may keep at most a few buffers' worth
    assert rss1 - rss0 < 32 * 1024, (rss0, rss1)
    # and it still serves
    assert client.get(f"{pod.base_url}/healthz").status_code == 200


def test_listener_bodies_and_names_hostile(hostile):
    pod, sql, client = hostile
    before = sql.state()
    cases = [
        ("bot", b'{"url": "http://127.0.0.1:9/\xff"}'),
        ("bot", json.dumps({"url": "http://127.0.0.1:9/\x00"}).encode()),
        ("bot", json.dumps({"url": 5}).encode()),
        ("bot", json.dumps({"url": "http://a/", "enabled": "yes"}).encode()),
        ("bot", json.dumps({"url": "http://a/", "secret": "whsec_\x00"}).encode()),
        ("bot", b"[" * 100_000 + b"]" * 100_000),
        ("bot", b'{"url": "http://a/' + b"a" * 3000 + b'"}'),
        ("bo%00t", json.dumps({"url": "http://a/"}).encode()),
        ("x" * 129, json.dumps({"url": "http://a/"}).encode()),
        ("%C3%A9", json.dumps({"url": "http://a/"}).encode()),
        ("%FF", json.dumps({"url": "http://a/"}).encode()),
    ]
    for name, raw in cases:
        resp = client.put(
            f"{pod.base_url}/listeners/{name}", content=raw, headers={"Content-Type": "application/json", **admin()}
        )
        assert_json_error(resp, 400, 404, 413)
    assert sql.state() == before


def test_offset_and_query_parameters_hostile(hostile):
    pod, sql, client = hostile
    before = sql.state()
    for body in ({"seq": 2**70}, {"seq": -1}, {"seq": "1"}, {"seq": 1.5}, {"seq": True}, [], {"seq": None}):
        resp = client.put(f"{pod.base_url}/listeners/bot/offset", json=body, headers=admin())
        assert_json_error(resp, 400)
    for query in ("limit=abc", "limit=0", "limit=99999999999999999999999", "status=bogus", "before=-5",
                  "before=99999999999999999999", "listener=" + "x" * 200, "listener=%00"):
        resp = client.get(f"{pod.base_url}/deliveries?{query}", headers=admin())
        assert resp.status_code < 500, (query, resp.status_code, resp.text[:300])
        if resp.status_code >= 400:
            assert_json_error(resp)
    for raw_id in ("abc", "0", "-1", "99999999999999999999999", "1e5", "%00"):
        for method, path in (("GET", f"/deliveries/{raw_id}"), ("POST", f"/deliveries/{raw_id}/redeliver")):
            resp = client.request(method, pod.base_url + path, headers=admin())
            assert_json_error(resp, 400, 404)
    for after in ("abc", "-1", "99999999999999999999999"):
        resp = client.get(f"{pod.base_url}/listeners/bot/stream?after={after}", headers=admin())
        assert_json_error(resp, 400)
    assert sql.state() == before


# ------------------------------------------------------------------------------------------
# Auth on every guarded route
# ------------------------------------------------------------------------------------------
GUARDED = {
    "ingest": [("POST", "/events", valid_event())],
    "admin": [
        ("GET", "/listeners", None),
        ("GET", "/listeners/bot", None),
        ("PUT", "/listeners/bot", {"url": "http://127.0.0.1:9/evil"}),
        ("DELETE", "/listeners/bot", None),
        ("GET", "/listeners/bot/offset", None),
        ("PUT", "/listeners/bot/offset", {"seq": 1}),
        ("GET", "/listeners/bot/stream", None),
        ("GET", "/deliveries", None),
        ("GET", "/deliveries/1", None),
        ("POST", "/deliveries/1/redeliver", None),
    ],
}
BAD_AUTH = {
    "missing": None,
    "wrong": f"Bearer {WRONG_TOKEN_CANARY}",
    "empty_bearer": "Bearer",
    "bearer_spaces": "Bearer  \t x",
    "basic_scheme": f"Basic {WRONG_TOKEN_CANARY}",
    "no_scheme": ADMIN_TOKEN,
    "two_tokens": f"Bearer {ADMIN_TOKEN} {INGEST_TOKENS[0]}",
    "prefix_of_token": f"Bearer {ADMIN_TOKEN[:-1]}",
    "token_plus_char": f"Bearer {ADMIN_TOKEN}x",
    "non_ascii": "Bearer t\u00f6ken",
    "huge": "Bearer " + "A" * 6000,
}


def _guarded_cases():
    for kind, routes in GUARDED.items():
        for method, path, body in routes:
            for bad in BAD_AUTH:
                yield pytest.param(kind, method, path, body, bad, id=f"{method} {path} {bad}")
            # the other token class must not open the route either
            yield pytest.param(kind, method, path, body, "other_kind", id=f"{method} {path} other_kind")


@pytest.mark.parametrize("kind,method,path,body,bad", list(_guarded_cases()))
def test_every_guarded_route_refuses_bad_tokens_with_401(hostile, kind, method, path, body, bad):
    pod, sql, client = hostile
    before = sql.state()
    if bad == "other_kind":
        header = f"Bearer {INGEST_TOKENS[0] if kind == 'admin' else ADMIN_TOKEN}"
    else:
        header = BAD_AUTH[bad]
    headers = {"Content-Type": "application/json"}
    if header is not None:
        headers["Authorization"] = header.encode("utf-8")  # raw bytes: non-ASCII too
    resp = client.request(
        method, pod.base_url + path, content=None if body is None else json.dumps(body).encode(), headers=headers
    )
    err = assert_json_error(resp, 401)
    assert err["error"] == "unauthorized"
    assert sql.state() == before


def test_both_ingest_tokens_work_rotation(hostile):
    pod, sql, client = hostile
    for i in (0, 1):
        resp = client.post(
            f"{pod.base_url}/events", json=valid_event(content=f"rotation {i} {CONTENT_CANARY}"), headers=ingest(i)
        )
        assert resp.status_code == 202, resp.text


def test_token_comparison_is_constant_time_over_every_token(monkeypatch):
    """No timing assertions (shared CI); instead: hmac.compare_digest is used, once per
    configured token, whether or not an early token already matched."""
    from relay_trio.web import auth

    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    assert auth.token_matches("tok-a", ["tok-a", "tok-b", "tok-c"])
    assert len(calls) == 3
    calls.clear()
    assert not auth.token_matches("nope", ["tok-a", "tok-b", "tok-c"])
    assert len(calls) == 3


# ------------------------------------------------------------------------------------------
# Logs (runs last in this module: zz_)
# ------------------------------------------------------------------------------------------
def test_zz_no_token_secret_or_body_in_logs(hostile):
    pod, sql, client = hostile
    # make sure something was logged for refused requests and accepted events
    client.post(f"{pod.base_url}/events", json=valid_event(content=CONTENT_CANARY), headers=ingest())
    client.get(f"{pod.base_url}/listeners", headers={"Authorization": f"Bearer {WRONG_TOKEN_CANARY}"})
    text = pod.log_text()
    assert text, "the pod logged nothing at all"
    for secret in (*INGEST_TOKENS, ADMIN_TOKEN, WRONG_TOKEN_CANARY, *pod.secrets):
        assert secret not in text, f"a token or secret appears in the log: {secret[:6]}..."
    info_lines = [r for r in pod.log_records() if r.get("level") in ("info", "warning", "error")]
    assert not any(CONTENT_CANARY in json.dumps(r) for r in info_lines), "an event body was logged at info level"


def test_keep_alive_connection_survives_early_rejections(hostile):
    """401/400 answered before the body is read must not leave the connection stuck: the
    next request on the same keep-alive connection is answered (relay_trio.web.body_drain)."""
    pod, sql, _ = hostile
    with httpx.Client(timeout=5) as client:
        for i in range(30):
            refused = client.post(
                f"{pod.base_url}/events", content=json.dumps(valid_event()).encode() * 3,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {WRONG_TOKEN_CANARY}"},
            )
            assert refused.status_code == 401
            bad_name = client.put(f"{pod.base_url}/listeners/%20", json={"url": "http://a/"}, headers=admin())
            assert bad_name.status_code == 400
            ok = client.get(f"{pod.base_url}/listeners/bot", headers=admin())
            assert ok.status_code == 200, i
