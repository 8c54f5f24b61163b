#!/usr/bin/env python3
"""What a knob of the queue order does: mean, p99 and step per value.

The knob is ``--param``: ``aging_cap_s`` (a cap on the aging window, the default),
``progress_s`` (key credit per ended action of the same trajectory) or
``generation_credit`` (an API call's key credit per second of its trajectory's
generation), PolicyParams fields read by ``tangram.policy.order``. Runs ``tangram`` (the default policy) with the
knob at its default ("none") and at each value given, on each workload, batch and seed,
next to the workload's baselines (which the knob does not touch), and prints one JSON
object with ``--json``: per point, every value's measures and the best baseline per
measure among those that failed no call (``api-naive`` fails calls, see the load sweep;
``failing_baselines`` lists any such with its count). The simulator is
deterministic for a seed: the spread is across seeds, not repeats.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.policy.snapshot import PolicyParams  # noqa: E402
from tangram.simulator.policies import PolicySpec  # noqa: E402
from tangram.simulator.sim import Simulation  # noqa: E402
from tangram.simulator.workload import load_workload  # noqa: E402

MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")


def _measures(summary: dict) -> dict:
    return {m: round(summary[m], 3) for m in MEASURES}


KNOBS = ("aging_cap_s", "progress_s", "generation_credit")


def point(workload: str, batch: int, seed: int, caps: list[float], param: str = "aging_cap_s") -> dict:
    wl = load_workload(workload).with_batch(batch)
    runs = {"none": _measures(Simulation(wl, "tangram", seed=seed).run().summary)}
    for cap in caps:
        spec = PolicySpec("tangram", params=replace(PolicyParams(), **{param: cap}))
        runs[f"{cap:g}"] = _measures(Simulation(wl, spec, seed=seed).run().summary)
    summaries = {p: Simulation(wl, p, seed=seed).run().summary for p in wl.baselines.compare}
    failing = {p: r["failed"] for p, r in summaries.items() if r["failed"]}
    base = {p: _measures(r) for p, r in summaries.items() if p not in failing}
    best = {m: min(((p, r[m]) for p, r in base.items()), key=lambda pr: pr[1]) for m in MEASURES}
    return {"workload": workload, "batch": batch, "seed": seed, "tangram": runs,
            "best_baseline": {m: {"policy": p, "value": v} for m, (p, v) in best.items()},
            "failing_baselines": failing,
            "at_or_below_every_baseline": {cap: all(r[m] <= best[m][1] * (1 + 1e-6) for m in MEASURES)
                                           for cap, r in runs.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["mopd-skewed", "mopd"])
    ap.add_argument("--batches", nargs="+", type=int, default=[512, 1024, 2048])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--param", choices=KNOBS, default="aging_cap_s", help="the PolicyParams field to vary")
    ap.add_argument("--caps", "--values", nargs="+", type=float, default=[5.0, 10.0, 20.0],
                    help="its values (seconds; generation_credit: seconds per second of generation)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    rows = []
    for w in args.workloads:
        for b in args.batches:
            for s in args.seeds:
                row = point(w, b, s, args.caps, args.param)
                rows.append(row)
                if not args.json:
                    cells = "  ".join(
                        f"{args.param} {c}: {r['mean_act_s']:.2f}/{r['p99_act_s']:.1f}/{r['step_time_s']:.0f}"
                        for c, r in row["tangram"].items())
                    best = "/".join(f"{v['value']:.1f}" for v in row["best_baseline"].values())
                    print(f"{w} {b} seed {s}: {cells}  best baseline {best}", flush=True)
    if args.json:
        print(json.dumps({"measures": list(MEASURES), "param": args.param, "caps": args.caps, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
