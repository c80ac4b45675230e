"""Scenario drivers 1-5 and 7 (relay pods as real processes, the public HTTP API only).

Latency everywhere = listener arrival (time.time_ns in the listener process) minus the
moment the POST /events response was fully read (time.time_ns in the producer). Both are
CLOCK_REALTIME on this host. A negative value means the delivery reached the listener
before the producer finished reading its 202 (possible with hand-off: delivery starts right
after COMMIT, in parallel with the HTTP response).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from bench.httpclient import Conn
from bench.infra import Cluster, Listener, Pod, register, start_pods, stop_pods
from bench.report import pct


@dataclass
class Sent:
    """What producers saw: event id -> (t_response_ns, accept_ms, mentioned listener)."""

    done: dict[str, tuple[int, float, str]] = field(default_factory=dict)
    errors: dict[int, int] = field(default_factory=dict)
    t_first_ns: int = 0
    t_last_ns: int = 0

    def add(self, eid: str, t_sent: int, t_done: int, listener: str) -> None:
        self.done[eid] = (t_done, (t_done - t_sent) / 1e6, listener)
        if not self.t_first_ns or t_sent < self.t_first_ns:
            self.t_first_ns = t_sent
        self.t_last_ns = max(self.t_last_ns, t_done)


@dataclass
class Outcome:
    latencies_ms: list[float]
    lost: int
    duplicates: int
    arrivals: int
    first_arrival_ns: int
    last_arrival_ns: int
    per_listener: dict[str, list[float]]
    arrival_ns: list[int]


def join(sent: Sent, records: list[list], prefix_filter: str | None = None) -> Outcome:
    seen: dict[tuple[str, str], int] = {}
    lat: list[float] = []
    per: dict[str, list[float]] = {}
    dups = 0
    arrivals = []
    for arrival_ns, listener, eid, _wid in records:
        if eid not in sent.done:
            continue
        key = (listener, eid)
        if key in seen:
            dups += 1
            continue
        seen[key] = arrival_ns
        arrivals.append(arrival_ns)
        t_done, _, _ = sent.done[eid]
        ms = (arrival_ns - t_done) / 1e6
        lat.append(ms)
        per.setdefault(listener, []).append(ms)
    lost = sum(1 for eid, (_, _, lst) in sent.done.items() if (lst, eid) not in seen)
    return Outcome(lat, lost, dups, len(arrivals), min(arrivals, default=0), max(arrivals, default=0), per, arrivals)


async def post_event(conn: Conn, eid: str, mentions: list[str]):
    body = {"id": eid, "channel": "bench", "author": "bench", "content": "hello @" + " @".join(mentions), "mentions": mentions}
    return await conn.request("POST", "/events", body)


async def produce_for(conns: list[Conn], sent: Sent, seconds: float, prefix: str, pick_listener, *, rate: float | None = None,
                      max_events: int | None = None):
    """Each connection is one producer posting back to back (or paced at `rate` events/s total)
    until `seconds` pass or `max_events` are accepted."""
    deadline = time.monotonic() + seconds
    counter = [0]
    t0 = time.monotonic()
    rng = random.Random(7)

    async def one(p: int, conn: Conn) -> None:
        i = 0
        while time.monotonic() < deadline:
            if max_events is not None and counter[0] >= max_events:
                return
            if rate:
                # global pacing: event k is due at t0 + k/rate
                k = counter[0]
                counter[0] += 1
                delay = t0 + k / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                counter[0] += 1
            eid = f"{prefix}-{p}-{i}"
            i += 1
            listener = pick_listener(rng)
            try:
                status, doc, t_sent, t_done = await post_event(conn, eid, [listener])
            except OSError:
                sent.errors[-1] = sent.errors.get(-1, 0) + 1
                await asyncio.sleep(0.05)
                continue
            if status == 202 and doc.get("deliveries"):
                sent.add(eid, t_sent, t_done, listener)
            else:
                sent.errors[status] = sent.errors.get(status, 0) + 1

    await asyncio.gather(*(one(p, c) for p, c in enumerate(conns)))


FANOUT = 10  # listeners per throughput scenario (see register_many)


async def register_many(pod: Pod, listener: Listener, prefix: str, n: int = FANOUT) -> list[str]:
    """n listener names, all served by the fast listener.

    Why several: a pod gives one listener at most RELAY_LISTENER_SHARE (default half) of
    its RELAY_MAX_IN_FLIGHT slots, so a one-listener benchmark would measure that cap, not
    the relay. Events mention one of these at random; the peers' single queue with worker
    concurrency 10 is the equivalent."""
    names = [f"{prefix}-agent{k}" for k in range(n)]
    for name in names:
        await register(pod, name, listener.url(name))
    return names


async def close_all(conns: list[Conn]) -> None:
    for c in conns:
        await c.close()


async def stage_means(pod: Pod) -> dict[str, float]:
    """Mean commit->claim (per path) and commit->delivered, ms, from the pod's /metrics
    histograms (measured inside the pod against the row's created_at: the in-pod part of the
    latency)."""
    c = Conn("127.0.0.1", pod.port)
    try:
        status, text, *_ = await c.request("GET", "/metrics")
    except OSError:
        return {}
    finally:
        await c.close()
    if status != 200 or not isinstance(text, (bytes, str)):
        return {}
    if isinstance(text, bytes):
        text = text.decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for metric, label in (("relay_commit_to_claim_seconds", "claim"), ("relay_commit_to_delivered_seconds", "delivered")):
            for kind, store in (("_sum", sums), ("_count", counts)):
                if line.startswith(metric + kind):
                    key = label
                    if 'path="' in line:
                        key += ":" + line.split('path="', 1)[1].split('"', 1)[0]
                    store[key] = float(line.rsplit(" ", 1)[1])
    return {k: sums[k] / counts[k] * 1000 for k in sums if counts.get(k)}


async def outbox_counts(dsn: str) -> dict[str, int]:
    """Outbox rows by status: tells a backlog still draining (pending) from a loss."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT status, count(*) AS n FROM deliveries GROUP BY status")
    finally:
        await conn.close()
    return {r["status"]: r["n"] for r in rows}


async def db_stages(dsn: str, records: list[list]) -> dict[str, float]:
    """Median per-stage times, ms, joining the outbox rows' own timestamps (database clock,
    same host) with the listener's arrival stamps: insert -> claim -> listener arrival ->
    settled. created_at is clock_timestamp() at the row insert, just before COMMIT."""
    import asyncpg

    arrivals = {eid: a for a, _l, eid, _w in records}
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT e.id, extract(epoch FROM d.created_at) AS c, extract(epoch FROM d.claimed_at) AS k, "
            "extract(epoch FROM d.delivered_at) AS s, d.claimed_via AS via FROM deliveries d JOIN events e ON e.seq = d.event_seq"
        )
    finally:
        await conn.close()
    ins_claim, claim_arr, arr_settled = [], [], []
    for r in rows:
        a = arrivals.get(r["id"])
        if a is None or r["k"] is None:
            continue
        c, k = float(r["c"]) * 1000, float(r["k"]) * 1000
        ins_claim.append(k - c)
        claim_arr.append(a / 1e6 - k)
        if r["s"] is not None:
            arr_settled.append(float(r["s"]) * 1000 - a / 1e6)
    return {"insert->claim": pct(ins_claim, 50), "claim->arrival": pct(claim_arr, 50),
            "arrival->settled": pct(arr_settled, 50)}


# -- scenario 1 ------------------------------------------------------------------------------
async def seed_latency(cluster: Cluster, listener: Listener, count: int, gap: tuple[float, float], log) -> dict:
    """Three rows at once, each on its own database with its own random schedule."""
    rows = {
        "poll-only (hand-off and LISTEN off)": ("s1_poll", [("s1-poll", dict(handoff_enabled=False, listen_enabled=False, notify_mode="off"))]),
        "same-pod hand-off": ("s1_handoff", [("s1-handoff", {})]),
        "cross-pod NOTIFY (saved on A, routed by B)": (
            "s1_notify", [("s1-notify-a", dict(routes="nobody-here")), ("s1-notify-b", dict(routes="*"))]),
    }
    results: dict[str, Outcome] = {}

    async def one_row(label: str, dbname: str, specs: list, seed: int) -> None:
        dsn = await asyncio.to_thread(cluster.new_database, dbname)
        pods = await start_pods([(n, dsn, s) for n, s in specs])
        try:
            lname = f"{dbname}-agent"
            await register(pods[0], lname, listener.url(lname))
            await asyncio.sleep(1.5)  # registry reaches pod B; poll reaches its idle ceiling
            sent = Sent()
            conn = Conn("127.0.0.1", pods[0].port)
            rng = random.Random(seed)
            for i in range(count):
                await asyncio.sleep(rng.uniform(*gap))
                status, doc, t_sent, t_done = await post_event(conn, f"{dbname}-{i}", [lname])
                if status == 202 and doc.get("deliveries"):
                    sent.add(f"{dbname}-{i}", t_sent, t_done, lname)
                else:
                    sent.errors[status] = sent.errors.get(status, 0) + 1
                    log(f"  {label}: POST -> {status} {doc}")
            await conn.close()
            await asyncio.sleep(2.5)  # the poll-only row waits up to the idle ceiling
            results[label] = join(sent, await listener.records())
            results[label].breakdown = await stage_means(pods[-1])  # type: ignore[attr-defined]
            results[label].stages = await db_stages(dsn, await listener.records())  # type: ignore[attr-defined]
        finally:
            stop_pods(pods)

    await asyncio.gather(*(one_row(lbl, db, specs, seed) for seed, (lbl, (db, specs)) in enumerate(rows.items(), 1)))
    return {lbl: results[lbl] for lbl in rows if lbl in results}


# -- scenario 2 and 3 ------------------------------------------------------------------------------
async def throughput(cluster: Cluster, listener: Listener, dbname: str, producers: int, pods_n: int, seconds: float,
                     *, notify_mode: str = "coalesced", cross_pod: bool = False, drain: float = 90.0,
                     extra: dict | None = None) -> dict:
    dsn = await asyncio.to_thread(cluster.new_database, dbname)
    if cross_pod:
        specs = [(f"{dbname}-a", dsn, dict(routes="nobody-here", notify_mode=notify_mode)),
                 (f"{dbname}-b", dsn, dict(routes="*", notify_mode=notify_mode))]
    else:
        specs = [(f"{dbname}-{k}", dsn, dict(notify_mode=notify_mode, **(extra or {}))) for k in range(pods_n)]
    pods = await start_pods(specs)
    try:
        names = await register_many(pods[0], listener, dbname)
        await asyncio.sleep(1.2)
        await listener.reset()
        targets = [pods[0]] if cross_pod else pods
        conns = [Conn("127.0.0.1", targets[p % len(targets)].port) for p in range(producers)]
        sent = Sent()
        t0 = time.time_ns()
        await produce_for(conns, sent, seconds, dbname, lambda rng: rng.choice(names))
        t_stop = time.time_ns()
        await close_all(conns)
        await listener.wait_for(len(sent.done), drain)
        await listener.wait_quiet(3.0, quiet=1.0)
        out = join(sent, await listener.records())
        outbox = await outbox_counts(dsn)
        window = (t_stop - t0) / 1e9
        during = sum(1 for a in out.arrival_ns if a <= t_stop)
        accept = [v[1] for v in sent.done.values()]
        return {
            "accepted": len(sent.done), "errors": dict(sent.errors), "seconds": window,
            "accepted_per_s": len(sent.done) / window,
            "delivered_per_s_during": during / window,
            "delivered_per_s_overall": out.arrivals / max((out.last_arrival_ns - t0) / 1e9, 1e-9),
            "lat_p50": pct(out.latencies_ms, 50), "lat_p99": pct(out.latencies_ms, 99),
            "accept_p50": pct(accept, 50), "accept_p99": pct(accept, 99),
            "lost": out.lost, "duplicates": out.duplicates, "arrivals": out.arrivals,
            "still_pending": outbox.get("pending", 0), "dead": outbox.get("dead", 0),
        }
    finally:
        stop_pods(pods)


# -- scenario 4 ------------------------------------------------------------------------------------
async def burst(cluster: Cluster, listener: Listener, n: int, producers: int = 16, drain: float = 60.0) -> dict:
    dsn = await asyncio.to_thread(cluster.new_database, "s4_burst")
    pods = await start_pods([("s4-burst", dsn, {})])
    try:
        names = await register_many(pods[0], listener, "s4")
        await asyncio.sleep(1.0)
        await listener.reset()
        conns = [Conn("127.0.0.1", pods[0].port) for _ in range(producers)]
        sent = Sent()
        await produce_for(conns, sent, 120.0, "s4", lambda rng: rng.choice(names), max_events=n)
        await close_all(conns)
        await listener.wait_for(len(sent.done), drain)
        await listener.wait_quiet(3.0, quiet=1.0)
        out = join(sent, await listener.records())
        return {
            "posted": n, "accepted": len(sent.done), "errors": dict(sent.errors),
            "accept_s": (sent.t_last_ns - sent.t_first_ns) / 1e9,
            "last_delivery_s": (out.last_arrival_ns - sent.t_first_ns) / 1e9 if out.arrivals else float("nan"),
            "lost": out.lost, "duplicates": out.duplicates,
            "lat_p50": pct(out.latencies_ms, 50), "lat_p99": pct(out.latencies_ms, 99),
        }
    finally:
        stop_pods(pods)


# -- scenario 5 -------------------------------------------------------------------------------------
async def head_of_line(cluster: Cluster, listener: Listener, seconds: float, rate: float, stalled: bool,
                       delivery_timeout: float = 2.0) -> dict:
    db = "s5_stalled" if stalled else "s5_baseline"
    dsn = await asyncio.to_thread(cluster.new_database, db)
    pods = await start_pods([(f"s5-{'stalled' if stalled else 'baseline'}", dsn, dict(delivery_timeout=delivery_timeout))])
    try:
        healthy = [f"{db}-h{k}" for k in range(1, 10)]
        names = list(healthy)
        for h in healthy:
            await register(pods[0], h, listener.url(h))
        if stalled:
            await register(pods[0], f"{db}-stalled", listener.url(f"{db}-stalled", stall=True))
            names.append(f"{db}-stalled")
        await asyncio.sleep(1.0)
        await listener.reset()
        conns = [Conn("127.0.0.1", pods[0].port) for _ in range(8)]
        sent = Sent()
        # Mixed traffic: each event mentions one listener; with the stalled one present,
        # 1 in 10 events goes to it. Healthy listeners get the same rate in both runs.
        total_rate = rate * len(names) / 9
        await produce_for(conns, sent, seconds, db, lambda rng: rng.choice(names), rate=total_rate)
        await close_all(conns)
        healthy_n = sum(1 for v in sent.done.values() if v[2] in healthy)
        await listener.wait_for(healthy_n, 30.0)
        await listener.wait_quiet(3.0, quiet=1.0)
        records = [r for r in await listener.records() if r[1] in healthy]
        only_healthy = Sent(done={k: v for k, v in sent.done.items() if v[2] in healthy})
        out = join(only_healthy, records)
        return {
            "events": len(sent.done), "healthy_events": healthy_n, "healthy_lost": out.lost,
            "p50": pct(out.latencies_ms, 50), "p99": pct(out.latencies_ms, 99), "max": max(out.latencies_ms, default=float("nan")),
            "errors": dict(sent.errors),
        }
    finally:
        stop_pods(pods)


# -- scenario 7 ---------------------------------------------------------------------------------------
async def memory(cluster: Cluster, listener: Listener, checkpoints: list[int], producers: int = 8, log=print,
                 rate: float | None = None) -> dict:
    dsn = await asyncio.to_thread(cluster.new_database, "s7_memory")
    pods = await start_pods([("s7-memory", dsn, {})])
    pod = pods[0]
    try:
        names = await register_many(pod, listener, "s7")
        await asyncio.sleep(1.0)
        await listener.reset()
        rss: dict[int, int] = {}
        samples: list[tuple[int, int, float]] = []
        sent = Sent()
        conns = [Conn("127.0.0.1", pod.port) for _ in range(producers)]
        t0 = time.monotonic()
        done = 0
        for cp in checkpoints:
            await produce_for(conns, sent, 3600.0, f"s7-{cp}", lambda rng: rng.choice(names), max_events=cp - done,
                              rate=rate)
            done = len(sent.done)
            await listener.wait_for(done, 120.0)
            await asyncio.sleep(1.0)
            rss[cp] = pod.rss_kib()
            samples.append((done, rss[cp], time.monotonic() - t0))
            log(f"  memory: {done} events accepted, RSS {rss[cp] / 1024:.1f} MiB, {time.monotonic() - t0:.0f}s")
        await close_all(conns)
        out = join(sent, await listener.records())
        outbox = await outbox_counts(dsn)
        return {"still_pending": outbox.get("pending", 0), "rss_kib": rss, "samples": samples, "lost": out.lost, "duplicates": out.duplicates,
                "lat_p50": pct(out.latencies_ms, 50), "lat_p99": pct(out.latencies_ms, 99),
                "seconds": time.monotonic() - t0, "accepted": len(sent.done)}
    finally:
        stop_pods(pods)
