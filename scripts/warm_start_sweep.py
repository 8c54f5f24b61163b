#!/usr/bin/env python
"""What the GPU nodes' warm start (the default, ``gpu_nodes[].warm_start``) gains on the built-in load sweeps.

    python scripts/warm_start_sweep.py [--seeds 0 1 2] [--workloads mopd ...] [--batches 256 ...] [--jobs 2]
        [--json]

For each stored sweep (seed 0: ``docs/results/load-sweep-all``; seed N: ``docs/results/load-sweep-seeds/
seed-N``), each workload whose jobs use GPUs and each batch, every policy that runs tangram's GPU manager
(tangram and the workload's ``api-naive`` / ``api-retry``) runs again with its GPU nodes cold (each model
loaded when a request first needs it), as before the warm start was the default; the warm runs are the
stored sweep's, as are ``static-services`` and ``serverless`` (GPUs of their own) on both sides. A point
counts as met where tangram is at or below every baseline of the workload's ``baselines.compare`` that did
all its work on all three measures (the sweep's own rule: a baseline more than 1e-6 below is a loss).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tangram.simulator import simulate  # noqa: E402
from tangram.simulator.policies import has_warm_start, policy_spec, warm_started  # noqa: E402
from tangram.simulator.workload import load_workload  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")


def sweep_dir(seed: int) -> Path:
    return RESULTS / ("load-sweep-all" if seed == 0 else f"load-sweep-seeds/seed-{seed}")


def stored_sweep(seed: int) -> dict:
    results = json.loads((sweep_dir(seed) / "results.json").read_text())
    if results.get("seed", 0) != seed:
        raise SystemExit(f"{sweep_dir(seed)}: ran seed {results.get('seed')}, not {seed}")
    return results["load_sweep"]["workloads"]


def uses_gpu(name: str) -> bool:
    wl = load_workload(name)
    return any(cl.rtype == "gpu" for j in wl.jobs for cl in j.actions + j.rewards)


def warm_policies(name: str) -> list[str]:
    compare = load_workload(name).baselines.compare
    return ["tangram"] + [p for p in compare if has_warm_start(policy_spec(p))]


def _row(s: dict) -> list:
    return [s[m] for m in MEASURES] + [s.get("failed", 0)]


def _run(job: tuple) -> tuple:
    seed, name, batch, policy = job
    t0 = time.perf_counter()
    wl = load_workload(name).with_batch(batch)
    s = simulate(wl, warm_started(policy_spec(policy), False), seed=seed).summary
    print(f"seed {seed} {name} {batch} {policy}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return job, _row(s)


def met(results: dict[str, list], compare: list[str]) -> list[str]:
    """The baselines (of ``compare``, that did all their work) ahead of tangram on some measure: [] is met."""
    t = results["tangram"]
    return sorted(p for p in compare if p in results and not results[p][3]
                  and any(results[p][i] < t[i] * (1 - 1e-6) for i in range(3)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workloads", nargs="+", help="default: every GPU workload of the stored sweeps")
    ap.add_argument("--batches", type=int, nargs="+", help="default: every batch of the stored sweeps")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    sweeps = {s: stored_sweep(s) for s in args.seeds}
    names = sorted({n for w in sweeps.values() for n in w if uses_gpu(n)})
    if args.workloads:
        unknown = sorted(set(args.workloads) - set(names))
        if unknown:
            raise SystemExit(f"--workloads: {unknown} are not GPU workloads of the stored sweeps ({names})")
        names = [n for n in names if n in args.workloads]
    points, jobs = {}, []
    for seed, workloads in sweeps.items():
        for name in names:
            compare = list(load_workload(name).baselines.compare)
            for row in workloads[name]["rows"]:
                if args.batches and row["batch"] not in args.batches:
                    continue
                warm = {p: _row(r) for p, r in row["results"].items() if p == "tangram" or p in compare}
                points[f"{name}@{row['batch']}@{seed}"] = {"compare": compare, "cold": {}, "warm": warm}
                jobs += [(seed, name, row["batch"], p) for p in warm_policies(name)]
    if not jobs:
        raise SystemExit("nothing to run: no stored point matches --workloads / --batches")
    jobs.sort(key=lambda j: -j[2])  # the largest batches first: they take longest
    if args.jobs > 1:
        with Pool(args.jobs) as pool:
            done = list(pool.imap_unordered(_run, jobs))
    else:
        done = [_run(job) for job in jobs]
    for (seed, name, batch, policy), row in done:
        points[f"{name}@{batch}@{seed}"]["cold"][policy] = row
    for p in points.values():
        p["cold"] = {**{k: v for k, v in p["warm"].items() if k not in p["cold"]}, **p["cold"]}
        p["behind_cold"], p["behind_warm"] = met(p["cold"], p["compare"]), met(p["warm"], p["compare"])
    out = {"note": "tangram and the baselines on tangram's GPU manager rerun with every GPU node cold; warm runs "
                   "(the default) and static-services / serverless from the stored sweeps. Each policy: mean, "
                   "p99, step, failed actions. behind_*: the baselines that did all their work and are below "
                   "tangram on some measure",
           "seeds": args.seeds,
           "met": {"cold": sum(not p["behind_cold"] for p in points.values()),
                   "warm": sum(not p["behind_warm"] for p in points.values()), "points": len(points)},
           "points": dict(sorted(points.items()))}
    if args.json:
        print(json.dumps(out))
        return 0
    for key, p in out["points"].items():
        cold, warm = ", ".join(p["behind_cold"]) or "-", ", ".join(p["behind_warm"]) or "-"
        print(f"{key:<24} behind cold: {cold:<32} warm: {warm}")
    print(f"at or below every baseline that did all its work: {out['met']['cold']} of {out['met']['points']} "
          f"points cold, {out['met']['warm']} with the warm start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
