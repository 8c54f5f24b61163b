#!/usr/bin/env python3
"""Per-action overhead of the CPU executors for a trivial command (``true``).

One sample of an executor = CPU manager allocate + cgroup / container update
+ exec + release, timed end to end. The bare baseline is the same command
run with ``asyncio.create_subprocess_exec("bash", "-c", "true")`` (pipes
collected, like the executors do). Variants are interleaved sample by sample
(so load drift hits all alike); overhead = median(variant) - median(bare),
and the median of the paired differences is reported too.

    python scripts/bench_executors.py --json [-n 50] [--docker-n 30] [--no-docker]

Docker samples alternate the action's cores so every sample pays the
``CpusetCpus``/``NanoCpus`` update; ``docker_same_cores`` shows the cached
case, and ``docker_raw_exec`` a bare exec_create/start/inspect of ``true``
(what the Docker Engine itself costs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tangram.executors.base import Placement  # noqa: E402
from tangram.executors.local import LocalExecutor  # noqa: E402
from tangram.managers.cpu import CpuManager, discover_local_node  # noqa: E402


def _stats(samples: list[float], bare: list[float] | None) -> dict:
    ms = [s * 1e3 for s in samples]
    out = {"n": len(ms), "median_ms": round(statistics.median(ms), 3),
           "p10_ms": round(_q(ms, 0.1), 3), "p90_ms": round(_q(ms, 0.9), 3)}
    if bare is not None:
        b = [s * 1e3 for s in bare]
        out["bare_median_ms"] = round(statistics.median(b), 3)
        out["overhead_ms"] = round(statistics.median(ms) - statistics.median(b), 3)
        k = min(len(ms), len(b))
        out["paired_overhead_ms"] = round(statistics.median(m - x for m, x in zip(ms[:k], b[:k])), 3)
    return out


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


async def bare_once() -> float:
    t = time.perf_counter()
    p = await asyncio.create_subprocess_exec("bash", "-c", "true", stdin=asyncio.subprocess.DEVNULL,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    await p.communicate()
    return time.perf_counter() - t


async def executor_once(manager: CpuManager, pool: str, ex, env_id: str, i: int, units: int = 1,
                        block: int = 0) -> tuple[float, dict]:
    """One timed allocate + exec + release; ``block`` cores are held (untimed) by
    another holder first, which steers the grant to other cores."""
    if block:
        manager.allocate(pool, block, "bench-blocker")
    try:
        t = time.perf_counter()
        holder = f"bench-{i}"
        cores = manager.allocate(pool, units, holder)
        try:
            r = await ex.exec(env_id, "true", Placement(holder, pool.split("@")[1], dop=units, cores=cores))
        finally:
            manager.release(pool, holder)
        dt = time.perf_counter() - t
    finally:
        manager.release(pool, "bench-blocker")
    if r.status != "succeeded":
        raise RuntimeError(f"bench command failed: {r}")
    return dt, {"isolation": r.isolation, **r.details}


async def main(args) -> dict:
    node = discover_local_node("local")
    manager = CpuManager([node])
    pool = "cpu@local"
    out: dict = {"n": args.n, "cores": list(node.cores), "command": "true"}

    local = LocalExecutor(isolation="auto")
    local_aff = LocalExecutor(isolation="affinity")
    for ex in (local, local_aff):
        await ex.create_environment("bench")
    for _ in range(3):  # warm up both paths
        await bare_once()
        await executor_once(manager, pool, local, "bench", -1)
        await executor_once(manager, pool, local_aff, "bench", -2)
    bare, loc, aff = [], [], []
    iso = None
    for i in range(args.n):
        bare.append(await bare_once())
        dt, det = await executor_once(manager, pool, local, "bench", i)
        loc.append(dt)
        iso = det["isolation"]
        aff.append((await executor_once(manager, pool, local_aff, "bench", i))[0])
    out["bare_subprocess"] = _stats(bare, None)
    out["local"] = {"isolation": iso, **_stats(loc, bare)}
    out["local_affinity"] = {"isolation": "affinity", **_stats(aff, bare)}
    for ex in (local, local_aff):
        await ex.close()

    if args.no_docker:
        out["docker"] = {"skipped": "--no-docker"}
    else:
        out.update(await bench_docker(args, manager, pool, node))
    manager.check_invariants()
    assert all(p.free == p.capacity for p in manager.pool_states()), "the bench leaked units"
    return out


async def bench_docker(args, manager: CpuManager, pool: str, node) -> dict:
    from tangram.executors.docker_image import engine_error

    why = engine_error()
    if why is not None:
        return {"docker": {"skipped": f"no Docker Engine: {why}"}}
    from tangram.executors.docker import DockerExecutor

    ex = DockerExecutor()
    try:
        await ex.create_environment("bench")
        cid = ex.container_id("bench")
        api = ex.client.api

        def raw_exec() -> float:
            t = time.perf_counter()
            e = api.exec_create(cid, ["true"])
            api.exec_start(e["Id"], demux=True)
            api.exec_inspect(e["Id"])
            return time.perf_counter() - t

        alternate = len(node.cores) > 1
        for i in range(3):
            await bare_once()
            await executor_once(manager, pool, ex, "bench", -10 - i, block=i % 2 if alternate else 0)
            await asyncio.to_thread(raw_exec)
        bare, upd, same, raw = [], [], [], []
        n_upd = 0
        for i in range(args.docker_n):
            bare.append(await bare_once())
            # alternate cores: every sample pays the CpusetCpus/NanoCpus update (when >1 core)
            blk = i % 2 if alternate else 0
            dt, det = await executor_once(manager, pool, ex, "bench", i, block=blk)
            upd.append(dt)
            n_upd += bool(det.get("cpu_update"))
            dt, det = await executor_once(manager, pool, ex, "bench", 10_000 + i, block=blk)
            same.append(dt)  # same cores as the previous exec: the update is skipped
            raw.append(await asyncio.to_thread(raw_exec))
        return {
            "docker": {"updates": n_upd, **_stats(upd, bare)},
            "docker_same_cores": _stats(same, bare),
            "docker_raw_exec": _stats(raw, bare),
        }
    finally:
        await ex.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("-n", type=int, default=50, help="local samples per variant")
    ap.add_argument("--docker-n", type=int, default=30, help="docker samples per variant")
    ap.add_argument("--no-docker", action="store_true")
    args = ap.parse_args()
    result = asyncio.run(main(args))
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
