"""`python -m bench [--quick] [--only 1,2,...]`: run the scenarios, print Markdown tables,
write bench/RESULTS.md.

Each scenario's section is also kept in bench/.work/results/sN.md, and RESULTS.md is
assembled from the newest section of every scenario, so `--only` re-runs one scenario
without losing the others (each section says when and in which mode it ran). A `--quick`
run keeps its own sections (bench/.work/results-quick/) and writes
bench/.work/RESULTS-quick.md, so a smoke run never replaces the full run's tables.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench import infra, scenarios
from bench.infra import Cluster, Listener
from bench.report import fmt, pct, table, verdict

RESULTS = infra.BENCH / "RESULTS.md"
SECTIONS = infra.WORK / "results"


def use_quick_outputs() -> None:
    global RESULTS, SECTIONS
    RESULTS = infra.WORK / "RESULTS-quick.md"
    SECTIONS = infra.WORK / "results-quick"
TITLES = {
    1: "1. Seed latency table",
    2: "2. Throughput",
    3: "3. The NOTIFY commit lock",
    4: "4. Burst",
    5: "5. Head-of-line",
    6: "6. Store instruments",
    7: "7. Memory",
    8: "8. Peers, side by side",
}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Run:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.summary: dict = {}

    # -- 1 ------------------------------------------------------------------------------
    async def s1(self, cluster: Cluster, listener: Listener) -> str:
        count = 4 if self.quick else 20
        log(f"scenario 1: {count} mentions per row, 2.5-4 s apart, three rows at once")
        res = await scenarios.seed_latency(cluster, listener, count, (2.5, 4.0), log)
        rows = []
        for label, out in res.items():
            v = out.latencies_ms
            rows.append([label, len(v), pct(v, 50), pct(v, 90), max(v, default=math.nan), out.lost, out.duplicates])
        self.summary["s1"] = {lbl: {"p50": pct(o.latencies_ms, 50), "p90": pct(o.latencies_ms, 90),
                                    "max": max(o.latencies_ms, default=math.nan)} for lbl, o in res.items()}
        ho = self.summary["s1"].get("same-pod hand-off", {})
        xp = self.summary["s1"].get("cross-pod NOTIFY (saved on A, routed by B)", {})
        stages = []
        for label, out in res.items():
            b = getattr(out, "breakdown", {}) or {}
            st = getattr(out, "stages", {}) or {}
            stages.append([label] + [", ".join(f"{k} {v:.2f}" for k, v in sorted(b.items()) if k.startswith("claim")) or "-",
                                     fmt(b.get("delivered")), fmt(st.get("insert->claim")), fmt(st.get("claim->arrival")),
                                     fmt(st.get("arrival->settled"))])
        targets = [
            ["hand-off median <= 1.5 ms", fmt(ho.get("p50")), verdict(_le(ho.get("p50"), 1.5))],
            ["hand-off p90 <= 2.5 ms", fmt(ho.get("p90")), verdict(_le(ho.get("p90"), 2.5))],
            ["hand-off max <= 10 ms", fmt(ho.get("max")), verdict(_le(ho.get("max"), 10))],
            ["cross-pod median <= 2.5 ms", fmt(xp.get("p50")), verdict(_le(xp.get("p50"), 2.5))],
        ]
        return (
            f"{count} mentions per row, spaced uniformly at random 2.5-4 s apart (the poll sits at its 2 s idle "
            "ceiling). The three rows ran at the same time, each with its own pods, database and random schedule. "
            "Latency: POST /events response read -> listener arrival, ms. Reference system: 684-871 ms poll-only, "
            "3.0 ms hand-off, 1.9 ms NOTIFY.\n\n"
            + table(["path", "n", "median ms", "p90 ms", "max ms", "lost", "dup"], rows)
            + "\n\nWhere the time goes: means from the delivering pod's /metrics histograms (commit -> claim by claim "
            "path, commit -> delivered), and medians joining each outbox row's timestamps (created_at, claimed_at, "
            "delivered_at; database clock, same host) with the listener's arrival stamp, ms:\n\n"
            + table(["path", "mean commit -> claim (by claim path)", "mean commit -> delivered", "median insert -> claim",
                     "median claim -> listener arrival", "median arrival -> settled"], stages)
            + "\n\n" + table(["target", "measured", "verdict"], targets)
        )

    # -- 2 ------------------------------------------------------------------------------
    async def s2(self, cluster: Cluster, listener: Listener) -> str:
        seconds = 3 if self.quick else 20
        rows = []
        configs = [(1, 10), (2, 32)] if self.quick else [(1, 10), (1, 32), (2, 10), (2, 32)]
        for pods_n, producers in configs:
            if True:
                log(f"scenario 2: {producers} producers, {pods_n} pod(s), {seconds}s")
                r = await scenarios.throughput(cluster, listener, f"s2_{pods_n}p_{producers}c", producers, pods_n, seconds)
                self.summary.setdefault("s2", {})[f"{pods_n}/{producers}"] = r
                rows.append([pods_n, producers, r["accepted"], r["accepted_per_s"], r["delivered_per_s_during"],
                             r["delivered_per_s_overall"], r["lat_p50"], r["lat_p99"], r["accept_p50"], r["accept_p99"],
                             r["lost"], r.get("still_pending", "-"), r["duplicates"], _errs(r["errors"])])
        return (
            f"Producers post back to back for {seconds} s, one mention per event (one of 10 registered listeners at "
            "random, all served by the fast listener: one listener alone is capped at RELAY_LISTENER_SHARE = half the "
            "in-flight slots), to the pods round-robin (each producer keeps one connection). deliveries/s during = arrivals before the producers stopped / "
            "window; overall = all arrivals / (last arrival - start). Then every accepted event is checked at the "
            "listener: not arrived = accepted but not at the listener after a drain of up to 90 s; of which still pending = those rows "
            "still pending in the outbox at that moment (a backlog, not a loss); dup = arrived more than once.\n\n"
            + table(["pods", "producers", "accepted", "accepted/s", "deliveries/s during", "deliveries/s overall",
                     "delivery p50 ms", "delivery p99 ms", "accept p50 ms", "accept p99 ms", "not arrived", "of which still pending",
                     "dup", "non-202"], rows)
        )

    # -- 3 ------------------------------------------------------------------------------
    async def s3(self, cluster: Cluster, listener: Listener) -> str:
        seconds = 3 if self.quick else 20
        rows = []
        res = {}
        for mode in ("off", "in-tx", "coalesced"):
            log(f"scenario 3: 32 producers to pod A, routed by pod B, RELAY_NOTIFY_MODE={mode}, {seconds}s")
            r = await scenarios.throughput(cluster, listener, f"s3_{mode.replace('-', '')}", 32, 2, seconds,
                                           notify_mode=mode, cross_pod=True)
            res[mode] = r
            rows.append([mode, r["accepted"], r["accepted_per_s"], r["accept_p50"], r["accept_p99"], r["lat_p50"],
                         r["lat_p99"], r["lost"], r["duplicates"], _errs(r["errors"])])
        self.summary["s3"] = res
        off, co, itx = res["off"]["accepted_per_s"], res["coalesced"]["accepted_per_s"], res["in-tx"]["accepted_per_s"]
        within = co >= 0.9 * off
        return (
            f"32 producers post for {seconds} s to pod A (RELAY_ROUTES names no real listener); every mention is "
            "routed only by pod B, so every row needs a cross-pod wake (with `off`, B's poll finds it).\n\n"
            + table(["RELAY_NOTIFY_MODE", "accepted", "accepted/s", "accept p50 ms", "accept p99 ms",
                     "delivery p50 ms", "delivery p99 ms", "not arrived (90 s drain)", "dup", "non-202"], rows)
            + "\n\n" + table(["target", "measured", "verdict"], [
                ["coalesced within 10 % of off (accepted/s)", f"{fmt(co)} vs {fmt(off)} ({_ratio(co, off)})", verdict(within)],
                ["what in-tx costs (accepted/s vs off)", f"{fmt(itx)} vs {fmt(off)} ({_ratio(itx, off)})", "info"],
            ])
        )

    # -- 4 ------------------------------------------------------------------------------
    async def s4(self, cluster: Cluster, listener: Listener) -> str:
        log("scenario 4: burst of 1000 mentions")
        r = await scenarios.burst(cluster, listener, 1000)
        self.summary["s4"] = r
        ok = r["lost"] == 0 and r["duplicates"] == 0 and r["accepted"] == 1000
        return (
            "1,000 mentions (each to one of 10 listeners) posted as fast as 16 connections allow to one pod; "
            "clock starts at the first POST.\n\n"
            + table(["accepted", "all accepted after s", "last delivery after s", "delivery p50 ms", "delivery p99 ms",
                     "lost", "dup", "non-202"],
                    [[r["accepted"], r["accept_s"], r["last_delivery_s"], r["lat_p50"], r["lat_p99"], r["lost"],
                      r["duplicates"], _errs(r["errors"])]])
            + f"\n\nAll delivered exactly once: {verdict(ok)}"
        )

    # -- 5 ------------------------------------------------------------------------------
    async def s5(self, cluster: Cluster, listener: Listener) -> str:
        seconds = 4 if self.quick else 20
        rate = 30.0  # events/s to the nine healthy listeners together
        res = {}
        for stalled in (False, True):
            log(f"scenario 5: head-of-line, stalled listener {'present' if stalled else 'absent'}, {seconds}s")
            res[stalled] = await scenarios.head_of_line(cluster, listener, seconds, rate, stalled)
        self.summary["s5"] = {"baseline": res[False], "stalled": res[True]}
        rows = [[("with the stalled listener" if k else "baseline: nine healthy only"), r["events"], r["healthy_events"],
                 r["p50"], r["p99"], r["max"], r["healthy_lost"]] for k, r in res.items()]
        ok = _le(res[True]["p99"], 2 * res[False]["p99"])
        return (
            f"One pod (RELAY_MAX_IN_FLIGHT 10, RELAY_DELIVERY_TIMEOUT 2 s), nine healthy listeners and one that "
            f"never answers; each event mentions one listener picked at random, paced so the healthy ones get "
            f"{rate:.0f} events/s together in both runs ({seconds} s). Latencies are the healthy listeners' only.\n\n"
            + table(["run", "events", "to healthy", "healthy p50 ms", "healthy p99 ms", "healthy max ms", "healthy lost"], rows)
            + "\n\n" + table(["target", "measured", "verdict"], [[
                "healthy p99 with the stall <= 2x without",
                f"{fmt(res[True]['p99'])} vs {fmt(res[False]['p99'])} ({_ratio(res[True]['p99'], res[False]['p99'])})",
                verdict(ok)]])
        )

    # -- 6 ------------------------------------------------------------------------------
    async def s6(self, cluster: Cluster, listener: Listener) -> str:
        n = 500 if self.quick else 3000
        wake_n = 100 if self.quick else 300
        log(f"scenario 6: store instruments (n={n}, wake n={wake_n})")
        dsn = await asyncio.to_thread(cluster.new_database, "s6_store")
        args = [sys.executable, "-m", "bench.store_probe", "--dsn", dsn, "--n", str(n), "--wake-n", str(wake_n)]
        if self.quick:
            args.append("--quick")
        proc = await asyncio.create_subprocess_exec(*args, cwd=infra.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 900)
        if proc.returncode != 0:
            raise RuntimeError(f"store_probe failed: {err.decode()[-1500:]}")
        r = json.loads(out)
        self.summary["s6"] = r
        enq = [[f"synchronous_commit={k}", v["n"], v["p50"], v["p90"], v["p99"], v["max"]] for k, v in r["enqueue"].items()]
        w = r["wake"]
        claims = [[k.split("/")[0], int(k.split("/")[1]), v["n"], v["claimed"], v["p50"], v["p90"], v["p99"]]
                  for k, v in r["claims"].items()]
        return (
            "Through the product's seam (`relay_trio.db.Database.run_tx`, one trio->asyncio crossing per operation), "
            "in a separate process (`python -m bench.store_probe`).\n\n"
            "**begin + enqueue (event + outbox row) + commit**, ms:\n\n"
            + table(["setting", "n", "p50", "p90", "p99", "max"], enq)
            + f"\n\n**NOTIFY wake probe** ({w['n']} commits 25 ms apart; COMMIT sent -> trio task woken by the "
            "LISTEN callback on a dedicated connection), ms:\n\n"
            + table(["n", "p50", "p99", "max"], [[w["n"], w["p50"], w["p99"], w["max"]]])
            + "\n\n**Claim latency by wake path** (one row per claim, k concurrent claimers; "
            f"{r.get('claims_sql')}), ms:\n\n"
            + table(["path", "claimers", "claims", "rows claimed", "p50", "p90", "p99"], claims)
        )

    # -- 7 ------------------------------------------------------------------------------
    async def s7(self, cluster: Cluster, listener: Listener) -> str:
        cps = [1000, 4000] if self.quick else [10000, 100000]
        log(f"scenario 7: memory at {cps} events")
        rate = 150.0
        r = await scenarios.memory(cluster, listener, cps, log=log, rate=rate)
        self.summary["s7"] = r
        a, b = (r["rss_kib"][c] for c in cps)
        ok = b <= 1.2 * a
        rows = [[n, f"{kib / 1024:.1f}", f"{t:.0f}"] for n, kib, t in r["samples"]]
        return (
            f"One pod, 8 producers paced at {rate:.0f} events/s together (steady load; slower if the pod cannot keep up), "
            f"one mention each, to one of 10 listeners; RSS of the pod "
            f"process (/proc/PID/status VmRSS) after each checkpoint. Not arrived by the end {r['lost']} (still pending in the "
            f"outbox {r.get('still_pending', '-')}), dup {r['duplicates']}, "
            f"delivery p50 {fmt(r['lat_p50'])} ms, p99 {fmt(r['lat_p99'])} ms.\n\n"
            + table(["events accepted", "RSS MiB", "elapsed s"], rows)
            + "\n\n" + table(["target", "measured", "verdict"], [[
                f"RSS after {cps[1]:,} within 20 % of after {cps[0]:,}", f"{b / 1024:.1f} vs {a / 1024:.1f} MiB ({_ratio(b, a)})",
                verdict(ok)]])
        )

    # -- 8 ------------------------------------------------------------------------------
    async def s8(self, cluster: Cluster, listener: Listener) -> str:
        from bench import peers_scenario

        return await peers_scenario.run(self, cluster, listener, log)


def _le(x, bound) -> bool | None:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return x <= bound


def _ratio(a, b) -> str:
    try:
        return f"{a / b:.2f}x"
    except (TypeError, ZeroDivisionError):
        return "-"


def _errs(e: dict) -> str:
    return ", ".join(f"{k}:{v}" for k, v in sorted(e.items())) or "0"


def _merged_summaries() -> dict:
    merged: dict = {}
    for n in TITLES:
        f = SECTIONS / f"s{n}.json"
        if f.exists():
            try:
                data = json.loads(f.read_text())
            except ValueError:
                continue
            if f"s{n}" in data:
                merged[f"s{n}"] = data[f"s{n}"]
    return merged


def _num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def targets_at_a_glance() -> str:
    """Every target of the issue with the newest measured value (from each scenario's JSON)."""
    m = _merged_summaries()
    rows = []
    s1 = m.get("s1", {})
    ho = s1.get("same-pod hand-off", {})
    xp = s1.get("cross-pod NOTIFY (saved on A, routed by B)", {})
    for label, v, bound in (("1. hand-off median <= 1.5 ms", ho.get("p50"), 1.5), ("1. hand-off p90 <= 2.5 ms", ho.get("p90"), 2.5),
                            ("1. hand-off max <= 10 ms", ho.get("max"), 10), ("1. cross-pod median <= 2.5 ms", xp.get("p50"), 2.5)):
        rows.append([label, fmt(_num(v)) + " ms", verdict(_le(_num(v), bound))])
    s3 = m.get("s3", {})
    if s3:
        off, co, itx = (_num(s3.get(k, {}).get("accepted_per_s")) for k in ("off", "coalesced", "in-tx"))
        rows.append(["3. coalesced accepted/s within 10 % of off", f"{fmt(co)} vs {fmt(off)} ({_ratio(co, off)})",
                     verdict(None if math.isnan(co) or math.isnan(off) else co >= 0.9 * off)])
        rows.append(["3. what in-tx costs", f"{fmt(itx)}/s vs off {fmt(off)}/s; accept p99 "
                     f"{fmt(_num(s3.get('in-tx', {}).get('accept_p99')))} vs {fmt(_num(s3.get('off', {}).get('accept_p99')))} ms", "info"])
    s4 = m.get("s4", {})
    if s4:
        rows.append(["4. burst of 1,000: all delivered exactly once",
                     f"last delivery after {fmt(_num(s4.get('last_delivery_s')))} s; lost {s4.get('lost')}, dup {s4.get('duplicates')}",
                     verdict(s4.get("lost") == 0 and s4.get("duplicates") == 0)])
    s5 = m.get("s5", {})
    if s5:
        a, b = _num(s5.get("stalled", {}).get("p99")), _num(s5.get("baseline", {}).get("p99"))
        rows.append(["5. healthy p99 with a stalled listener <= 2x without", f"{fmt(a)} vs {fmt(b)} ms ({_ratio(a, b)})",
                     verdict(None if math.isnan(a) or math.isnan(b) else a <= 2 * b)])
    s7 = m.get("s7", {})
    if s7.get("rss_kib"):
        ks = sorted(s7["rss_kib"], key=lambda k: int(k))
        a, b = _num(s7["rss_kib"][ks[0]]), _num(s7["rss_kib"][ks[-1]])
        rows.append([f"7. RSS after {int(ks[-1]):,} events within 20 % of after {int(ks[0]):,}",
                     f"{b / 1024:.1f} vs {a / 1024:.1f} MiB ({_ratio(b, a)})", verdict(b <= 1.2 * a)])
    s8 = m.get("s8", {})
    if s8:
        lat = s8.get("latency", {})
        best = min((_num(v.get("p50")) for v in lat.values()), default=math.nan)
        rv = _num(ho.get("p50"))
        rows.append(["8. relay median latency <= half the best peer's", f"{fmt(rv)} vs best peer {fmt(best)} ms",
                     verdict(None if math.isnan(rv) or math.isnan(best) else rv <= best / 2)])
        thr = s8.get("throughput", {})
        s2 = m.get("s2", {})
        for producers in (10, 32):
            peers = [_num(v.get("delivered_per_s_overall")) for k, v in thr.items() if k.endswith(f"/{producers}")]
            relay = _num(s2.get(f"1/{producers}", {}).get("delivered_per_s_overall"))
            if peers and not math.isnan(relay):
                rows.append([f"8. relay deliveries/s >= best peer's ({producers} producers, 1 pod)",
                             f"{fmt(relay)} vs {fmt(max(peers))}", verdict(relay >= max(peers))])
    return "## Targets at a glance\n\n" + table(["target", "measured", "verdict"], rows) + "\n"


def header(info: dict, quick: bool, argv: list[str]) -> str:
    return (
        "# relay-trio benchmark results\n\n"
        "Reproduce: `bench/run` from the repository root (full run, about 12 minutes plus about 18 for scenario 7's "
        "100k events); `bench/run --only 2,3` re-runs some scenarios and keeps the others' latest sections; "
        "`bench/run --quick` is a smoke run of every scenario in under 3 minutes that writes "
        "bench/.work/RESULTS-quick.md instead of this file.\n\n"
        + table(["cores", "CPU", "Python", "PostgreSQL", "fsync", "synchronous_commit", "kernel"],
                [[info["cores"], info["cpu"], info["python"], info["postgres"], info["fsync"], info["synchronous_commit"],
                  info["kernel"]]])
        + "\n\nEverything runs on this one machine over loopback: PostgreSQL (a private cluster on a temp dir, "
        "real fsync), the relay pods (`relay-trio serve`, real processes), the fast listener "
        "(`bench/listener.py`) and the load generator (`bench/httpclient.py`). Latency = listener arrival "
        "(time.time_ns) minus the moment the producer read the POST /events response (time.time_ns), same clock.\n"
    )


async def amain(args) -> int:
    want = sorted({int(x) for x in args.only.split(",")}) if args.only else list(TITLES)
    if args.quick:
        use_quick_outputs()
    run = Run(args.quick)
    SECTIONS.mkdir(parents=True, exist_ok=True)
    log("starting PostgreSQL (private cluster, temp dir)")
    cluster = await asyncio.to_thread(Cluster)
    listener = Listener()
    info = infra.machine_info(cluster)
    log(f"machine: {info}")
    mode = "quick" if args.quick else "full"
    try:
        for n in want:
            t0 = time.monotonic()
            load0 = os.getloadavg()[0]
            try:
                body = await getattr(run, f"s{n}")(cluster, listener)
            except Exception as exc:  # a scenario that cannot run says why and the others go on
                traceback.print_exc()
                body = f"Did not complete: `{type(exc).__name__}: {str(exc)[:1500]}`"
            stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            section = (f"## {TITLES[n]}\n\n_{mode} run, {stamp}, {time.monotonic() - t0:.0f} s, "
                       f"load average at start {load0:.2f} (2 cores; other engineers' test runs share the machine)._\n\n"
                       + body + "\n")
            (SECTIONS / f"s{n}.md").write_text(section)
            (SECTIONS / f"s{n}.json").write_text(json.dumps(run.summary, default=str, indent=1))
            print("\n" + section, flush=True)
    finally:
        listener.stop()
        await asyncio.to_thread(cluster.stop)
    parts = [header(info, args.quick, sys.argv), targets_at_a_glance()]
    for n in TITLES:
        f = SECTIONS / f"s{n}.md"
        if f.exists():
            parts.append(f.read_text())
    notes = infra.BENCH / "NOTES.md"
    if notes.exists():
        parts.append(notes.read_text())
    RESULTS.write_text("\n".join(parts))
    log(f"wrote {RESULTS}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="short runs (under 3 minutes in all)")
    ap.add_argument("--only", default="", help="comma-separated scenario numbers (default: all)")
    args = ap.parse_args()
    return asyncio.run(amain(args))
