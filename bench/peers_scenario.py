"""Scenario 8: PgQueuer and Procrastinate doing the same push job as relay, side by side.

Same PostgreSQL cluster (a fresh database each), same listener, same latency definition:
the producer stamps time.time_ns() when the enqueue's COMMIT returned (relay: when the
POST /events response was read), the listener stamps arrival. The peers run in their own
venv (bench/.work/peers-venv) installed from PyPI by the runner; their producers call the
library's enqueue directly (no HTTP hop), which favours them on accept cost.
"""

from __future__ import annotations

import asyncio
import json
import math

from bench import infra, scenarios
from bench.report import fmt, pct, table, verdict

SYSTEMS = ("pgqueuer", "procrastinate")


def _outcome(sent_rows: list, listener_name: str, records: list) -> scenarios.Outcome:
    sent = scenarios.Sent()
    for eid, t_commit, accept_ms in sent_rows:
        sent.done[eid] = (t_commit, accept_ms, listener_name)
    return scenarios.join(sent, records)


async def _latency_row(system: str, cluster, listener, count: int, seed: int) -> dict:
    db = f"s8_{system}_lat"
    await asyncio.to_thread(cluster.new_database, db)
    dsn = cluster.libpq_dsn(db) if system == "procrastinate" else cluster.pg.dsn(db)
    await asyncio.to_thread(infra.peer_run, system, dsn, "install")
    lname = f"peer-{system}-lat"
    worker = await asyncio.to_thread(infra.PeerWorker, system, dsn, listener.url(lname), 10, 900)
    try:
        await asyncio.sleep(1.0)
        res = await asyncio.to_thread(infra.peer_run, system, dsn, "latency", "--count", str(count),
                                      "--prefix", f"{system}-lat", "--seed", str(seed))
        await asyncio.sleep(3.0)
        out = _outcome(res["sent"], lname, await listener.records())
        return {"n": len(out.latencies_ms), "p50": pct(out.latencies_ms, 50), "p90": pct(out.latencies_ms, 90),
                "max": max(out.latencies_ms, default=math.nan), "lost": out.lost, "dup": out.duplicates}
    finally:
        worker.stop()


async def _throughput_row(system: str, cluster, listener, producers: int, seconds: float) -> dict:
    db = f"s8_{system}_{producers}"
    await asyncio.to_thread(cluster.new_database, db)
    dsn = cluster.libpq_dsn(db) if system == "procrastinate" else cluster.pg.dsn(db)
    await asyncio.to_thread(infra.peer_run, system, dsn, "install")
    lname = f"peer-{system}-{producers}"
    worker = await asyncio.to_thread(infra.PeerWorker, system, dsn, listener.url(lname), 10, 900)
    try:
        await asyncio.sleep(1.0)
        await listener.reset()
        res = await asyncio.to_thread(infra.peer_run, system, dsn, "throughput", "--producers", str(producers),
                                      "--seconds", str(seconds), "--prefix", f"{system}-{producers}")
        sent_rows = res["sent"]
        await listener.wait_for(len(sent_rows), 60.0)
        await listener.wait_quiet(3.0, quiet=1.0)
        out = _outcome(sent_rows, lname, await listener.records())
        t0 = min((r[1] - int(r[2] * 1e6) for r in sent_rows), default=0)
        t_stop = max((r[1] for r in sent_rows), default=0)
        window = max((t_stop - t0) / 1e9, 1e-9)
        accept = [r[2] for r in sent_rows]
        return {
            "accepted": len(sent_rows), "accepted_per_s": len(sent_rows) / window,
            "delivered_per_s_during": sum(1 for a in out.arrival_ns if a <= t_stop) / window,
            "delivered_per_s_overall": out.arrivals / max((out.last_arrival_ns - t0) / 1e9, 1e-9),
            "lat_p50": pct(out.latencies_ms, 50), "lat_p99": pct(out.latencies_ms, 99),
            "accept_p50": pct(accept, 50), "accept_p99": pct(accept, 99), "lost": out.lost, "dup": out.duplicates,
        }
    finally:
        worker.stop()


def _relay_reference(run) -> tuple[dict, dict]:
    s1 = run.summary.get("s1")
    s2 = run.summary.get("s2")
    for key, name in (("s1", "s1.json"), ("s2", "s2.json")):
        if (key == "s1" and s1 is None) or (key == "s2" and s2 is None):
            from bench import runner as runner_module

            f = runner_module.SECTIONS / name
            if f.exists():
                data = json.loads(f.read_text()).get(key)
                if key == "s1":
                    s1 = data
                else:
                    s2 = data
    return s1 or {}, s2 or {}


async def run(run, cluster, listener, log) -> str:
    ok, why = await asyncio.to_thread(infra.ensure_peers_venv, log)
    if not ok:
        return f"The peers could not be installed here: `{why}`"
    versions = await asyncio.to_thread(infra.peer_versions)
    count = 3 if run.quick else 20
    seconds = 2 if run.quick else 20
    producer_counts = (10,) if run.quick else (10, 32)
    notes: list[str] = []

    log(f"scenario 8: peers latency, {count} jobs each, 2.5-4 s apart (both at once)")
    lat: dict[str, dict] = {}

    async def lat_one(system: str, seed: int) -> None:
        try:
            lat[system] = await _latency_row(system, cluster, listener, count, seed)
        except Exception as exc:
            notes.append(f"{system} latency run failed: `{type(exc).__name__}: {str(exc)[:800]}`")

    await asyncio.gather(*(lat_one(s, k) for k, s in enumerate(SYSTEMS, 11)))
    thr: dict[str, dict] = {}
    for system in SYSTEMS:
        for producers in producer_counts:
            log(f"scenario 8: {system} throughput, {producers} producers, {seconds}s")
            try:
                thr[f"{system}/{producers}"] = await _throughput_row(system, cluster, listener, producers, seconds)
            except Exception as exc:
                notes.append(f"{system} throughput ({producers}) failed: `{type(exc).__name__}: {str(exc)[:800]}`")
    run.summary["s8"] = {"latency": lat, "throughput": thr, "versions": versions}

    s1, s2 = _relay_reference(run)
    relay_lat = s1.get("same-pod hand-off", {})
    lat_rows = [["relay-trio (same-pod hand-off, scenario 1)", "-", relay_lat.get("p50"), relay_lat.get("p90"), relay_lat.get("max"), "-", "-"]]
    for s in SYSTEMS:
        if s in lat:
            r = lat[s]
            lat_rows.append([f"{s} {versions.get(s, '')}", r["n"], r["p50"], r["p90"], r["max"], r["lost"], r["dup"]])
    thr_rows = []
    for producers in (10, 32):
        rr = s2.get(f"1/{producers}")
        if rr:
            thr_rows.append([f"relay-trio, 1 pod (scenario 2)", producers, rr["accepted_per_s"], rr["delivered_per_s_during"],
                             rr["delivered_per_s_overall"], rr["lat_p50"], rr["lat_p99"], rr["lost"], rr["duplicates"]])
        for s in SYSTEMS:
            r = thr.get(f"{s}/{producers}")
            if r:
                thr_rows.append([s, producers, r["accepted_per_s"], r["delivered_per_s_during"], r["delivered_per_s_overall"],
                                 r["lat_p50"], r["lat_p99"], r["lost"], r["dup"]])

    best_peer_lat = min((lat[s]["p50"] for s in lat if not math.isnan(lat[s]["p50"])), default=math.nan)
    targets = [["relay median latency <= half the best peer's",
                f"{fmt(relay_lat.get('p50'))} vs best peer {fmt(best_peer_lat)} ms",
                verdict(None if relay_lat.get("p50") is None or math.isnan(best_peer_lat)
                        else relay_lat["p50"] <= best_peer_lat / 2)]]
    for producers in (10, 32):
        rr = s2.get(f"1/{producers}")
        peers = [thr[f"{s}/{producers}"]["delivered_per_s_overall"] for s in SYSTEMS if f"{s}/{producers}" in thr]
        if rr and peers:
            targets.append([f"relay deliveries/s >= best peer's ({producers} producers)",
                            f"{fmt(rr['delivered_per_s_overall'])} vs {fmt(max(peers))}",
                            verdict(rr["delivered_per_s_overall"] >= max(peers))])
    return (
        "The same push job on each peer: a producer commits one job per event (the library's own enqueue, its "
        "own pool, no HTTP hop), the peer's worker (concurrency 10, like RELAY_MAX_IN_FLIGHT) POSTs "
        "`{\"event\": {\"id\"}}` to the same listener with a reused httpx.AsyncClient. Latency: enqueue COMMIT "
        "returned -> listener arrival. Peers installed from PyPI in bench/.work/peers-venv: "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + ". PgQueuer uses asyncpg; Procrastinate uses "
        "psycopg 3 with LISTEN/NOTIFY on. Both with their default polling/notify settings.\n\n"
        f"**Latency** ({count} jobs, 2.5-4 s apart; both peers at once, each on its own database), ms:\n\n"
        + table(["system", "n", "median", "p90", "max", "lost", "dup"], lat_rows)
        + f"\n\n**Throughput** ({seconds} s of back-to-back producers; deliveries/s overall = arrivals / (last arrival - start)):\n\n"
        + table(["system", "producers", "accepted/s", "deliveries/s during", "deliveries/s overall", "p50 ms", "p99 ms",
                 "not arrived (60 s drain)", "dup"], thr_rows)
        + "\n\n" + table(["target", "measured", "verdict"], targets)
        + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else "")
    )
