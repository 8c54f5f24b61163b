#!/usr/bin/env python3
"""Do our own calls trip an upstream's rate limit? ``python scripts/bench_api_quota.py [--runs 3]``

An upstream HTTP API on loopback allows ``--concurrency`` calls at once and
``--quota`` calls per ``--period-s`` (counted at arrival on its own clock, 429
with ``Retry-After`` over either; ``tangram.demo.upstream_limits``), with a
latency drawn per call from ``--latency-s``. ``tangram serve`` runs as a
subprocess with an ``api_pools`` entry of exactly those limits; ``--callers``
concurrent clients each run one ``http`` action through it. Per run: 429s that
reached callers, 429s the upstream sent at all, peak concurrency and the most
arrivals in any period as the upstream saw them, wall time. ``--books`` runs
the pool's quota books of each kind side by side (interleaved, one seed each
per run). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aiohttp import web  # noqa: E402

from tangram.client import TangramClient  # noqa: E402
from tangram.demo.upstream_limits import UpstreamLimits, limits_middleware  # noqa: E402
from tangram.service.launch import ServeProcess, ServeStartError, start_serve  # noqa: E402


def max_in_window(arrivals: list[float], period: float) -> int:
    arrivals, best, j = sorted(arrivals), 0, 0
    for i, t in enumerate(arrivals):
        while arrivals[j] <= t - period:
            j += 1
        best = max(best, i - j + 1)
    return best


def start_service(cfg: Path) -> ServeProcess:
    # a throwaway state directory: a benchmark's service must neither share nor be refused the
    # default state directory of the nodes it serves (a real service may hold it)
    try:
        return start_serve(["--config", str(cfg), "--port", "0",
                            "--no-auth"],  # loopback benchmark
                           cwd=REPO, throwaway_state=True)
    except ServeStartError as exc:
        raise SystemExit(str(exc)) from None


async def one_run(args: argparse.Namespace, seed: int, books: str) -> dict:
    limits = UpstreamLimits(concurrency=args.concurrency, quota=args.quota, period_s=args.period_s,
                            window=args.window)
    rng = random.Random(seed)

    async def handle(request: web.Request) -> web.Response:
        await asyncio.sleep(rng.uniform(*args.latency_s))
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[limits_middleware(limits)])
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/search"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "cluster.yaml"
        cfg.write_text(json.dumps({
            "cpu_nodes": [{"name": "here", "executor": "local", "cores": 1, "memory_mb": 256}], "gpu_nodes": [],
            "api_pools": {"search": {"concurrency": args.concurrency, "quota": args.quota,
                                     "period_s": args.period_s, "window": args.window, "books": books}}}))
        with start_service(cfg) as srv:
            async with TangramClient(srv.url) as c:
                t0 = time.monotonic()
                results = await asyncio.gather(*(
                    c.run_action({"kind": "http", "url": url, "resources": {"api": "search"}})
                    for _ in range(args.callers)))
                wall = time.monotonic() - t0
    await runner.cleanup()
    return {"books": books, "seed": seed,
            "caller_429s": sum(1 for r in results if (r.output or {}).get("status") == 429),
            "failed": sum(1 for r in results if not r.ok),
            "upstream_429s_sent": limits.stats.refused,
            "peak_concurrency": limits.stats.peak_concurrency,
            "max_arrivals_in_any_period": max_in_window(limits.stats.arrivals, args.period_s),
            "wall_s": round(wall, 3),
            "ideal_wall_s": round((args.callers / args.quota - 1) * args.period_s, 3)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--callers", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--quota", type=int, default=6)
    ap.add_argument("--period-s", type=float, default=2.0)
    ap.add_argument("--window", choices=["sliding", "fixed"], default="sliding")
    ap.add_argument("--latency-s", type=float, nargs=2, default=(0.05, 0.3),
                    help="upstream latency range per call (a hosted search API answers in tens to hundreds of ms)")
    ap.add_argument("--books", nargs="+", choices=["adaptive", "conservative"], default=["adaptive", "conservative"],
                    help="the API pool's quota books (tangram.managers.basic); several: interleaved per seed")
    ap.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always one JSON object")
    args = ap.parse_args()
    runs = [await one_run(args, seed, books) for seed in range(args.runs) for books in args.books]
    print(json.dumps({"limits": {"concurrency": args.concurrency, "quota": args.quota, "period_s": args.period_s,
                                 "window": args.window}, "callers": args.callers, "runs": runs}))


if __name__ == "__main__":
    asyncio.run(main())
