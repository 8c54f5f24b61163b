#!/usr/bin/env python3
"""Benchmark the service end to end: ``python scripts/bench_service.py [--json]``.

Starts ``tangram serve`` (embedded default: this machine, local executor) as a
subprocess and drives it with :class:`tangram.client.TangramClient`:

1. trivial ``exec`` actions (``true``) from 1, 64 and 512 concurrent clients,
   each in its own environment: actions/s, p50/p99 of the server-measured
   ``overhead_s`` (everything but queueing for cores and the process's run),
   and p50 of the client-side latency;
2. the same command spawned directly with ``asyncio.create_subprocess_exec``
   (``bash -c true``, pipes, as the local executor does) for reference;
3. 10,000 actions submitted with ``wait=false``, then polled: all complete,
   none lost. They are more than the service queues (``service.max_queued_per_job``
   1,024, ``max_queued_total`` 4,096): the client waits on its refusals
   (``admission_wait_s``), as the verl integration does, and the count of
   refusals waited on is reported (``admission_waits``);
4. the service's peak RSS (VmHWM).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tangram.client import TangramClient  # noqa: E402
from tangram.service.launch import ServeProcess, ServeStartError, start_serve  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs))) - 1))]


def start_service() -> ServeProcess:
    # a throwaway state directory: a benchmark's service must neither share nor be refused the
    # default state directory of the nodes it serves (a real service may hold it)
    try:
        return start_serve(["--port", "0", "--log-level", "WARNING",
                            "--no-auth"],  # loopback benchmark
                           cwd=REPO, throwaway_state=True)
    except ServeStartError as exc:
        raise SystemExit(str(exc)) from None


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def exec_level(c: TangramClient, clients: int, total: int) -> dict:
    envs = await asyncio.gather(*(c.create_environment() for _ in range(clients)))
    per = max(1, total // clients)
    overheads: list[float] = []
    latencies: list[float] = []
    execs: list[float] = []
    queues: list[float] = []
    failed = 0

    async def worker(env: str) -> None:
        nonlocal failed
        for _ in range(per):
            t0 = time.perf_counter()
            r = await c.exec(env, "true")
            latencies.append(time.perf_counter() - t0)
            if not r.ok:
                failed += 1
            overheads.append(r.timing.overhead_s)
            execs.append(r.timing.exec_s)
            queues.append(r.timing.queued_s)

    # warm-up (first spawns, cgroup parents)
    await asyncio.gather(*(c.exec(e, "true") for e in envs[: min(clients, 8)]))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(e) for e in envs))
    wall = time.perf_counter() - t0
    await asyncio.gather(*(c.delete_environment(e) for e in envs))
    n = per * clients
    return {"clients": clients, "actions": n, "failed": failed, "actions_per_s": n / wall,
            "overhead_p50_ms": pct(overheads, 50) * 1e3, "overhead_p99_ms": pct(overheads, 99) * 1e3,
            "exec_p50_ms": pct(execs, 50) * 1e3, "queued_p50_ms": pct(queues, 50) * 1e3,
            "latency_p50_ms": pct(latencies, 50) * 1e3, "latency_p99_ms": pct(latencies, 99) * 1e3}


async def direct_level(concurrency: int, total: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def one() -> None:
        async with sem:
            t0 = time.perf_counter()
            p = await asyncio.create_subprocess_exec("bash", "-c", "true", stdin=asyncio.subprocess.DEVNULL,
                                                     stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                     start_new_session=True)
            await p.communicate()
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "actions": total, "actions_per_s": total / wall,
            "latency_p50_ms": pct(lat, 50) * 1e3, "latency_p99_ms": pct(lat, 99) * 1e3}


async def queued(c: TangramClient, n: int) -> dict:
    sem = asyncio.Semaphore(64)
    waits0 = c.admission_waits
    before = (await c.stats())["actions"]
    done0 = sum(before.values())

    async def submit() -> str:
        async with sem:
            return await c.submit({"kind": "exec", "command": "true"})

    t0 = time.perf_counter()
    ids = await asyncio.gather(*(submit() for _ in range(n)))
    submitted = time.perf_counter() - t0
    peak_queue = 0
    while True:
        s = await c.stats()
        peak_queue = max(peak_queue, s["queue_length"])
        if sum(s["actions"].values()) - done0 >= n:
            break
        await asyncio.sleep(0.25)
    wall = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for i in range(0, n, 256):
        rs = await asyncio.gather(*(c.get_action(a) for a in ids[i:i + 256]))
        for r in rs:
            statuses[r.status] = statuses.get(r.status, 0) + 1
    s = await c.stats()
    whole = all(p["free"] == p["capacity"] for p in s["pools"].values())
    return {"actions": n, "unique_ids": len(set(ids)), "statuses": statuses,
            "lost": n - statuses.get("succeeded", 0), "submit_s": submitted, "wall_s": wall,
            "actions_per_s": n / wall, "peak_queue_length": peak_queue, "pools_whole_after": whole,
            "admission_waits": c.admission_waits - waits0}


async def main(args) -> dict:
    srv = start_service()
    url = srv.url
    out: dict = {"cores": len(os.sched_getaffinity(0)), "python": sys.version.split()[0]}
    try:
        async with TangramClient(url, timeout_s=600, admission_wait_s=600) as c:
            out["exec"] = []
            for clients, total in ((1, args.n1), (64, args.n64), (512, args.n512)):
                out["exec"].append(await exec_level(c, clients, total))
            out["queued"] = await queued(c, args.queued)
        out["service_peak_rss_mb"] = peak_rss_mb(srv.pid)
    finally:
        srv.stop(grace_s=30)
    out["direct"] = [await direct_level(k, n) for k, n in ((1, args.n1), (out["cores"], args.n64))]
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--n1", type=int, default=300)
    ap.add_argument("--n64", type=int, default=2048)
    ap.add_argument("--n512", type=int, default=3072)
    ap.add_argument("--queued", type=int, default=10_000)
    a = ap.parse_args()
    res = asyncio.run(main(a))
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for r in res["exec"]:
            print(f"exec x{r['clients']:>3}: {r['actions_per_s']:7.0f} actions/s  overhead p50 "
                  f"{r['overhead_p50_ms']:.2f} ms p99 {r['overhead_p99_ms']:.2f} ms  exec p50 {r['exec_p50_ms']:.2f} ms  latency p50 {r['latency_p50_ms']:.1f} ms")
        for r in res["direct"]:
            print(f"direct x{r['concurrency']:>2}: {r['actions_per_s']:7.0f} spawns/s  latency p50 {r['latency_p50_ms']:.2f} ms")
        q = res["queued"]
        print(f"queued {q['actions']}: lost {q['lost']}, {q['actions_per_s']:.0f} actions/s, peak queue {q['peak_queue_length']}, "
              f"{q['admission_waits']} refusals waited on")
        print(f"service peak RSS {res['service_peak_rss_mb']:.0f} MiB")
    _ = statistics  # (kept for ad-hoc use)
