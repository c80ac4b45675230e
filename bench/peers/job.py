"""The push job on a peer queue: commit a job, a worker POSTs it to the listener.

Runs inside the benchmark-only venv (bench/.work/peers-venv), started by the runner:

    python bench/peers/job.py --system pgqueuer|procrastinate --dsn DSN install
    python bench/peers/job.py ... worker --url http://127.0.0.1:P/l/peer --concurrency 10 --seconds S
    python bench/peers/job.py ... latency --count 20 --gap-min 2.5 --gap-max 4 --prefix X
    python bench/peers/job.py ... throughput --producers 10 --seconds 20 --prefix X

Producers print one JSON document on stdout: {"sent": [[event_id, t_commit_ns, accept_ms], ...]}
where t_commit_ns is time.time_ns() right after the enqueue's commit returned (the
equivalent of relay's "POST /events response received"). The worker POSTs
{"event": {"id": event_id}} with a reused httpx.AsyncClient (the relay's own HTTP client),
so the listener records it exactly as a relay delivery. Every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time

import httpx

ENTRY = "push"


# -- PgQueuer ---------------------------------------------------------------------------
async def pgq_install(dsn: str) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn)
    try:
        q = Queries(AsyncpgDriver(conn))
        if not await q.schema_is_installed():
            await q.install()
    finally:
        await conn.close()


async def pgq_worker(dsn: str, url: str, concurrency: int, seconds: float) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.models import Job
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    client = httpx.AsyncClient(timeout=5.0)

    @qm.entrypoint(ENTRY)
    async def push(job: Job) -> None:
        await client.post(url, content=job.payload, headers={"content-type": "application/json"})

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, qm.shutdown.set)
    loop.call_later(seconds, qm.shutdown.set)
    print("READY", flush=True)
    from datetime import timedelta

    await qm.run(dequeue_timeout=timedelta(seconds=30), batch_size=concurrency)
    await client.aclose()


async def pgq_producer_factory(dsn: str, n: int):
    import asyncpg
    from pgqueuer.db import AsyncpgPoolDriver
    from pgqueuer.queries import Queries

    pool = await asyncpg.create_pool(dsn, min_size=n, max_size=n)
    q = Queries(AsyncpgPoolDriver(pool))

    async def enqueue(event_id: str) -> None:
        await q.enqueue(ENTRY, json.dumps({"event": {"id": event_id}}).encode())

    return enqueue, pool.close


# -- Procrastinate ------------------------------------------------------------------------
def proc_app(dsn: str, url: str | None = None, client_box: list | None = None):
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name=ENTRY, queue="push")
    async def push(event_id: str) -> None:
        client = client_box[0]
        await client.post(
            url,
            content=json.dumps({"event": {"id": event_id}}).encode(),
            headers={"content-type": "application/json"},
        )

    return app, push


async def proc_install(dsn: str) -> None:
    import psycopg

    app, _ = proc_app(dsn)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        cur = await c.execute("SELECT to_regclass('procrastinate_jobs') IS NOT NULL")
        (present,) = await cur.fetchone()
    if not present:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()


async def proc_worker(dsn: str, url: str, concurrency: int, seconds: float) -> None:
    box: list = [httpx.AsyncClient(timeout=5.0)]
    app, _ = proc_app(dsn, url, box)
    async with app.open_async():
        task = asyncio.create_task(
            app.run_worker_async(
                queues=["push"], concurrency=concurrency, wait=True, listen_notify=True,
                install_signal_handlers=False, delete_jobs="successful",
            )
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.call_later(seconds, stop.set)
        print("READY", flush=True)
        await stop.wait()
        task.cancel()
        try:
            await asyncio.wait_for(task, 10)
        except (asyncio.CancelledError, asyncio.TimeoutError, Exception):
            pass
    await box[0].aclose()


async def proc_producer_factory(dsn: str, n: int):
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=dsn, min_size=n, max_size=n)
    )

    @app.task(name=ENTRY, queue="push")
    async def push(event_id: str) -> None:  # never run here: the worker process runs it
        pass

    await app.open_async()

    async def enqueue(event_id: str) -> None:
        await push.defer_async(event_id=event_id)

    return enqueue, app.close_async


# -- producers (same shape for both systems) ------------------------------------------------
async def produce_latency(factory, dsn: str, count: int, gap_min: float, gap_max: float, prefix: str, seed: int):
    enqueue, close = await factory(dsn, 1)
    rng = random.Random(seed)
    sent = []
    try:
        for i in range(count):
            await asyncio.sleep(rng.uniform(gap_min, gap_max))
            eid = f"{prefix}-{i}"
            t0 = time.time_ns()
            await enqueue(eid)
            t1 = time.time_ns()
            sent.append([eid, t1, (t1 - t0) / 1e6])
    finally:
        await close()
    return sent


async def produce_throughput(factory, dsn: str, producers: int, seconds: float, prefix: str):
    enqueue, close = await factory(dsn, producers)
    sent: list = []
    deadline = time.monotonic() + seconds

    async def one(p: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            eid = f"{prefix}-{p}-{i}"
            i += 1
            t0 = time.time_ns()
            await enqueue(eid)
            t1 = time.time_ns()
            sent.append([eid, t1, (t1 - t0) / 1e6])

    try:
        await asyncio.gather(*(one(p) for p in range(producers)))
    finally:
        await close()
    return sent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=["pgqueuer", "procrastinate"], required=True)
    ap.add_argument("--dsn", required=True)
    sub = ap.add_subparsers(dest="role", required=True)
    sub.add_parser("install")
    w = sub.add_parser("worker")
    w.add_argument("--url", required=True)
    w.add_argument("--concurrency", type=int, default=10)
    w.add_argument("--seconds", type=float, default=600)
    lat = sub.add_parser("latency")
    lat.add_argument("--count", type=int, default=20)
    lat.add_argument("--gap-min", type=float, default=2.5)
    lat.add_argument("--gap-max", type=float, default=4.0)
    lat.add_argument("--prefix", required=True)
    lat.add_argument("--seed", type=int, default=1)
    th = sub.add_parser("throughput")
    th.add_argument("--producers", type=int, default=10)
    th.add_argument("--seconds", type=float, default=20)
    th.add_argument("--prefix", required=True)
    a = ap.parse_args()

    pgq = a.system == "pgqueuer"
    if a.role == "install":
        asyncio.run((pgq_install if pgq else proc_install)(a.dsn))
        return 0
    if a.role == "worker":
        asyncio.run((pgq_worker if pgq else proc_worker)(a.dsn, a.url, a.concurrency, a.seconds))
        return 0
    factory = pgq_producer_factory if pgq else proc_producer_factory
    if a.role == "latency":
        sent = asyncio.run(produce_latency(factory, a.dsn, a.count, a.gap_min, a.gap_max, a.prefix, a.seed))
    else:
        sent = asyncio.run(produce_throughput(factory, a.dsn, a.producers, a.seconds, a.prefix))
    json.dump({"sent": sent}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
