#!/usr/bin/env python3
"""Latency of one scheduling round (policy only, and snapshot + policy).

Scenario (issue: foundation): one 256-core node, 64 waiting elastic
candidates (each up to 32 DoP options, Amdahl elasticity), 2,000 queued
actions in all, some cores busy; then the same at a larger size to show the
growth. Prints one JSON object with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.core.model import Action, Elasticity  # noqa: E402
from tangram.policy.schedule import plan  # noqa: E402
from tangram.policy.snapshot import PolicyParams, PoolState, Snapshot  # noqa: E402


def build_snapshot(cores: int, candidates: int, queued: int, options: int, seed: int) -> Snapshot:
    rng = random.Random(seed)
    min_units = cores // candidates  # the candidates' minimums exactly fill the node
    waiting = []
    for i in range(queued):
        lo = min_units
        waiting.append(Action.build(
            f"a{i}",
            {"cpu": {"min": lo, "max": lo + options - 1}},
            t1_s=rng.uniform(5.0, 120.0),
            elasticity=Elasticity.amdahl(rng.uniform(0.01, 0.3)),
            action_class=f"suite{i % 8}",
        ))
    running = tuple((rng.uniform(0.1, 30.0), 1) for _ in range(cores // 8))
    pools = {
        "cpu@n0": PoolState("cpu@n0", "cpu", "n0", cores + len(running), cores, running=running),
        "mem@n0": PoolState("mem@n0", "mem", "n0", 1 << 20, 1 << 20),
    }
    return Snapshot(pools=pools, nodes=("n0",), waiting=tuple(waiting), params=PolicyParams())


def measure(snap: Snapshot, repeats: int) -> dict:
    samples = []
    scheduled = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = plan(snap)
        samples.append((time.perf_counter() - t0) * 1e3)
        scheduled = len(p.dispatches)
    samples.sort()
    return {
        "round_median_ms": round(statistics.median(samples), 4),
        "round_p99_ms": round(samples[min(len(samples) - 1, int(0.99 * len(samples)))], 4),
        "round_min_ms": round(samples[0], 4),
        "scheduled": scheduled,
        "repeats": repeats,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    sizes = [
        {"cores": 256, "candidates": 64, "queued": 2000, "options": 32},
        {"cores": 1024, "candidates": 256, "queued": 8000, "options": 32},
    ]
    results = []
    for size in sizes:
        snap = build_snapshot(seed=args.seed, **size)
        plan(snap)  # warm caches and imports
        results.append({**size, **measure(snap, args.repeats)})
    out = {
        "round_median_ms": results[0]["round_median_ms"],
        "round_p99_ms": results[0]["round_p99_ms"],
        "target_median_ms": 1.0,
        "sizes": results,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for r in results:
            print(f"{r['cores']:>5} cores, {r['candidates']:>4} candidates, {r['queued']:>5} queued: "
                  f"median {r['round_median_ms']:.3f} ms, p99 {r['round_p99_ms']:.3f} ms, "
                  f"{r['scheduled']} scheduled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
