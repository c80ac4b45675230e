"""The lag gauges: oldest pending age per registered listener, labels bounded by the registry."""

from __future__ import annotations

import httpx
import trio

from relay_trio.lag import refresh_lag
from relay_trio.metrics import Metrics
from test_ops_metrics import value


async def _seed(conn, rows: list[tuple[str, float, str]]) -> None:
    """rows: (listener, age in seconds, status); also registers listeners a..z seen."""
    for name in sorted({r[0] for r in rows} | {"idle"}):
        await conn.execute(
            "INSERT INTO listeners (name, url, secret) VALUES ($1, 'http://127.0.0.1:9/x', 'whsec_x') "
            "ON CONFLICT DO NOTHING",
            name,
        )
    for i, (listener, age, status) in enumerate(rows):
        seq = await conn.fetchval(
            "INSERT INTO events (id, channel, author, content, body_hash) VALUES ($1, 'c', 'a', 'x', 'h') RETURNING seq",
            f"lag-{i}",
        )
        await conn.execute(
            "INSERT INTO deliveries (event_seq, listener, status, created_at) "
            "VALUES ($1, $2, $3, clock_timestamp() - make_interval(secs => $4::float8))",
            seq, listener, status, age,
        )


class FakePod:
    def __init__(self, db):
        self.db = db
        self.metrics = Metrics()


async def test_oldest_pending_age_per_listener(db):
    await db.run_tx(_seed, [("slow", 120.0, "pending"), ("slow", 30.0, "pending"), ("slow", 500.0, "delivered"),
                            ("fast", 2.0, "pending"), ("dead", 900.0, "dead")])
    pod = FakePod(db)
    published: set[str] = set()
    ages = await refresh_lag(pod, published)
    assert set(ages) == {"slow", "fast", "dead", "idle"}
    text = pod.metrics.render().decode()
    # the oldest *pending* row counts; delivered and dead rows never do
    assert 119 < value(text, "relay_oldest_pending_age_seconds", listener="slow") < 180
    assert 1 < value(text, "relay_oldest_pending_age_seconds", listener="fast") < 60
    assert value(text, "relay_oldest_pending_age_seconds", listener="dead") == 0
    assert 'relay_oldest_pending_age_seconds{listener="idle"} 0.0' in text


async def test_deleted_listener_label_is_removed_and_caught_up_listener_drops_to_zero(db):
    await db.run_tx(_seed, [("gone", 60.0, "pending"), ("busy", 60.0, "pending")])
    pod = FakePod(db)
    published: set[str] = set()
    await refresh_lag(pod, published)

    async def drop_and_deliver(conn):
        await conn.execute("DELETE FROM deliveries WHERE listener = 'gone'")
        await conn.execute("DELETE FROM listeners WHERE name = 'gone'")
        await conn.execute("UPDATE deliveries SET status = 'delivered' WHERE listener = 'busy'")

    await db.run_tx(drop_and_deliver)
    await refresh_lag(pod, published)
    text = pod.metrics.render().decode()
    assert 'listener="gone"' not in text
    assert value(text, "relay_oldest_pending_age_seconds", listener="busy") == 0


async def test_lag_component_runs_in_the_pod(pod_factory, db):
    pod = await pod_factory()
    await db.run_tx(_seed, [("laggy", 42.0, "pending")])
    async with httpx.AsyncClient(base_url=pod.base_url) as client:
        with trio.fail_after(15):
            while True:
                text = (await client.get("/metrics")).text
                if value(text, "relay_oldest_pending_age_seconds", listener="laggy") > 41:
                    break
                await trio.sleep(0.2)
    assert pod.tasks_alive.get("lag") is True
