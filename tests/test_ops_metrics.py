"""GET /metrics: Prometheus text format, and the issue-7 counters moving while events flow."""

from __future__ import annotations

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from proc_helpers import ADMIN_TOKEN, INGEST_TOKEN, RecordingListener, auth


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


# Every metric family issue 7 asks for (name as rendered, without the _total suffix).
ISSUE_7_FAMILIES = [
    "relay_events_accepted", "relay_events_rejected", "relay_outbox_enqueued",
    "relay_handoffs_sent", "relay_handoffs_dropped", "relay_notifies_sent", "relay_notifies_merged",
    "relay_deliveries", "relay_claims", "relay_wake_misses",
    "relay_commit_to_claim_seconds", "relay_commit_to_delivered_seconds",
    "relay_deliveries_in_flight", "relay_oldest_pending_age_seconds",
    "relay_listener_state", "relay_listener_reconnects", "relay_listener_heartbeat_rtt_seconds",
    "relay_janitor_sweeps",
]


async def test_metrics_endpoint_serves_prometheus_text(pod_factory):
    pod = await pod_factory()
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name for f in text_string_to_metric_families(resp.text)}
    missing = [name for name in ISSUE_7_FAMILIES if name not in families]
    assert not missing, missing


async def test_counters_move_while_events_flow(pod_factory):
    # routes=bot: rows for "other" are for other pods (this pod NOTIFYs them instead)
    pod = await pod_factory(ingest_tokens=INGEST_TOKEN, admin_token=ADMIN_TOKEN, poll_max=0.5, routes="bot",
                            janitor_interval=0.2, heartbeat_interval=0.2)
    with RecordingListener() as hook:
        async with httpx.AsyncClient(base_url=pod.base_url, timeout=10) as client:
            before = (await client.get("/metrics")).text
            r = await client.put("/listeners/bot", json={"url": hook.url}, headers=auth(ADMIN_TOKEN))
            assert r.status_code == 201, r.text
            r = await client.put("/listeners/other", json={"url": hook.url}, headers=auth(ADMIN_TOKEN))
            assert r.status_code == 201, r.text
            await trio.sleep(0.3)  # registry cache follows the NOTIFY
            for i in range(3):
                r = await client.post(
                    "/events",
                    json={"id": f"m-{i}", "channel": "c", "author": "a", "content": "hi @bot", "mentions": ["bot"]},
                    headers=auth(INGEST_TOKEN),
                )
                assert r.status_code == 202, r.text
            r = await client.post(
                "/events",
                json={"id": "o-1", "channel": "c", "author": "a", "content": "hi @other", "mentions": ["other"]},
                headers=auth(INGEST_TOKEN),
            )
            assert r.status_code == 202, r.text
            # rejected: bad token, and an invalid body
            r = await client.post("/events", json={"channel": "c"}, headers=auth("wrong"))
            assert r.status_code == 401
            r = await client.post("/events", json={"channel": "c"}, headers=auth(INGEST_TOKEN))
            assert r.status_code == 400
            ok = await trio.to_thread.run_sync(hook.wait_for, lambda h: len(h.received) >= 3, 20.0)
            assert ok, "deliveries did not arrive"
            await trio.sleep(1.2)  # janitor sweeps, heartbeats and the lag refresh come round
            after = (await client.get("/metrics")).text

    assert value(after, "relay_events_accepted_total") - value(before, "relay_events_accepted_total") == 4
    assert value(after, "relay_outbox_enqueued_total") == 4
    assert value(after, "relay_handoffs_sent_total") + value(after, "relay_handoffs_dropped_total") == 3
    assert value(after, "relay_notifies_sent_total", channel="relay_outbox") >= 1  # the "other" row
    assert value(after, "relay_janitor_sweeps_total") >= 1
    assert value(after, "relay_listener_heartbeat_rtt_seconds") > 0
    assert value(after, "relay_oldest_pending_age_seconds", listener="other") > 0  # nobody routes it
    assert value(after, "relay_oldest_pending_age_seconds", listener="bot") == 0
    rejected = {k: v for k, v in samples(after).items() if k[0] == "relay_events_rejected_total"}
    assert sum(rejected.values()) == 2, rejected
    assert value(after, "relay_listener_state", state="connected") == 1
    # delivery path
    assert value(after, "relay_deliveries_total", outcome="delivered") == 3
    claimed = sum(v for k, v in samples(after).items() if k[0] == "relay_claims_total")
    assert claimed == 3
    assert value(after, "relay_commit_to_claim_seconds_count", path="handoff") + value(
        after, "relay_commit_to_claim_seconds_count", path="notify"
    ) + value(after, "relay_commit_to_claim_seconds_count", path="poll") == 3
    assert value(after, "relay_commit_to_delivered_seconds_count") == 3
    assert value(after, "relay_deliveries_in_flight") == 0
    assert value(after, "relay_wake_misses_total") == 0
