"""Scenario 6, store instruments, through the product's trio/asyncpg seam (relay_trio.db).

Run in the project venv: ``python -m bench.store_probe --dsn DSN --n 3000``; prints JSON.

1. begin + enqueue + commit through the pool (Database.run_tx, one crossing): insert an
   event and its outbox row, n times, with synchronous_commit on and off (SET LOCAL).
2. NOTIFY wake probe: a dedicated LISTEN connection whose callback wakes a trio task;
   commits with pg_notify 25 ms apart; commit-to-wake = wake time minus the moment the
   COMMIT was sent (stamped inside the asyncio op just before the transaction exits).
3. Claim latency by wake path: k claimers (1, 8, 32) each claiming rows one at a time,
   by id (the hand-off path) or due-first (the NOTIFY/poll path), with the product's
   relay_trio.store.claims functions.
"""

from __future__ import annotations

import argparse
import json
import time

import trio

from relay_trio.db import Database, connect_dedicated, open_asyncio_loop

INSERT_EVENT = """
INSERT INTO events (id, channel, author, content, mentions, body_hash)
VALUES ($1, 'bench', 'bench', 'hi @probe', ARRAY['probe'], 'x') RETURNING seq
"""
INSERT_DELIVERY = "INSERT INTO deliveries (event_seq, listener) VALUES ($1, 'probe') RETURNING id"


def pct(v: list[float], p: float) -> float:
    if not v:
        return float("nan")
    s = sorted(v)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(v: list[float]) -> dict:
    return {"n": len(v), "p50": pct(v, 50), "p90": pct(v, 90), "p99": pct(v, 99), "max": max(v, default=float("nan"))}


async def enqueue_op(conn, eid: str, sync_commit: str):
    """The intake transaction's store work: the product's insert_event_tx (event + outbox
    rows in one statement), under SET LOCAL synchronous_commit."""
    from relay_trio.store.events import insert_event_tx

    await conn.execute(f"SET LOCAL synchronous_commit = {sync_commit}")
    return await insert_event_tx(conn, event_id=eid, channel="bench", author="bench", content="hi @probe",
                                 mentions=["probe"], meta_json="{}", body_hash="x")


async def add_probe_listener(conn) -> None:
    await conn.execute("INSERT INTO listeners (name, url, secret) VALUES ('probe', 'http://127.0.0.1:9/', 'whsec_eA==') "
                       "ON CONFLICT DO NOTHING")


async def bench_enqueue(db: Database, n: int, sync_commit: str, tag: str) -> dict:
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        await db.run_tx(enqueue_op, f"probe-{tag}-{i}", sync_commit)
        lat.append((time.perf_counter() - t0) * 1000)
    return summary(lat)


async def bench_wake(db: Database, dsn: str, n: int, spacing: float) -> dict:
    send, recv = trio.open_memory_channel(1000)
    conn = await connect_dedicated(dsn, "relay-bench-probe")

    def callback(_conn, _pid, _channel, payload) -> None:
        try:
            send.send_nowait((payload, time.time_ns()))
        except trio.WouldBlock:
            pass

    from trio_asyncio import aio_as_trio

    await aio_as_trio(conn.add_listener)("bench_probe", callback)
    commit_sent: dict[str, int] = {}

    async def notify_op(c, i: int) -> None:
        async with c.transaction():
            await c.execute("SELECT pg_notify('bench_probe', $1)", str(i))
            commit_sent[str(i)] = time.time_ns()  # the COMMIT goes out as the block exits

    lat = []
    async with trio.open_nursery() as nursery:
        async def reader() -> None:
            async for payload, t in recv:
                if payload in commit_sent:
                    lat.append((t - commit_sent[payload]) / 1e6)
                if len(lat) >= n:
                    return

        nursery.start_soon(reader)
        for i in range(n):
            await db.run(notify_op, i)
            await trio.sleep(spacing)
        with trio.move_on_after(5):
            while len(lat) < n:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    await aio_as_trio(conn.close)()
    return summary(lat)


def _spec(via: str):
    from relay_trio.store.claims import ClaimSpec

    return ClaimSpec(owner="probe", lease_seconds=30.0, routes=None, limit=1, via=via, budgets={}, default_budget=10)


async def claim_due_op(conn) -> list:
    from relay_trio.store.claims import claim_due

    return await claim_due(conn, _spec("poll"))


async def claim_by_id_op(conn, ids: list[int]) -> list:
    from relay_trio.store.claims import claim_by_id

    return await claim_by_id(conn, _spec("handoff"), ids)


async def make_rows(db: Database, n: int, tag: str) -> list[int]:
    async def op(conn) -> list[int]:
        ids = []
        for i in range(n):
            seq = await conn.fetchval(INSERT_EVENT, f"claim-{tag}-{i}")
            ids.append(await conn.fetchval(INSERT_DELIVERY, seq))  # plain row; claims are what is timed
        return ids

    return await db.run_tx(op, timeout=120)


async def bench_claims(db: Database, claimers: int, per: int, path: str) -> dict:
    ids = await make_rows(db, claimers * per, f"{path}-{claimers}")
    lat: list[float] = []
    got = [0]

    async def worker(k: int) -> None:
        mine = ids[k * per : (k + 1) * per]
        for j in range(per):
            t0 = time.perf_counter()
            if path == "by-id":
                rows = await db.run_tx(claim_by_id_op, [mine[j]])
            else:
                rows = await db.run_tx(claim_due_op)
            lat.append((time.perf_counter() - t0) * 1000)
            got[0] += len(rows)

    async with trio.open_nursery() as n:
        for k in range(claimers):
            n.start_soon(worker, k)
    out = summary(lat)
    out["claimed"] = got[0]
    async def cleanup(conn) -> None:
        await conn.execute("DELETE FROM deliveries")
    await db.run(cleanup)
    return out


async def main(dsn: str, n: int, wake_n: int, quick: bool) -> dict:
    async with open_asyncio_loop():
        from relay_trio.migrations import migrate_conn

        db = await Database.connect(dsn, min_size=2, max_size=34, op_timeout=30.0, acquire_timeout=30.0,
                                    application_name="relay-bench-probe")
        try:
            await db.run(migrate_conn, timeout=120)
            await db.run(add_probe_listener)
            res: dict = {"enqueue": {}, "claims": {}}
            await bench_enqueue(db, 100, "on", "warm")
            res["enqueue"]["on"] = await bench_enqueue(db, n, "on", "on")
            res["enqueue"]["off"] = await bench_enqueue(db, n, "off", "off")
            res["wake"] = await bench_wake(db, dsn, wake_n, 0.025)
            per = 20 if quick else 50
            for path in ("by-id", "due"):
                for k in (1, 8, 32):
                    res["claims"][f"{path}/{k}"] = await bench_claims(db, k, per, path)
            res["claims_sql"] = "the product's relay_trio.store.claims.claim_by_id / claim_due, limit 1"
            return res
        finally:
            await db.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--wake-n", type=int, default=300)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    print(json.dumps(trio.run(main, a.dsn, a.n, a.wake_n, a.quick)))
