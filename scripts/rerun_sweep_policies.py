#!/usr/bin/env python
"""Rerun some policies of a saved load sweep and update it in place (results, losses, table, plots).

    python scripts/rerun_sweep_policies.py docs/results/load-sweep-cpu --policies tangram tangram:fcfs \
        [--workloads ai-coding cpu-contended] [--batches 256 1024]

For a change that moves only some policies (e.g. tangram's own policy): the other policies'
runs are kept as they were, so a sweep whose baselines take hours is not rerun whole. The
seed is the sweep's own; ``runs`` in results.json records what was rerun, and with which code.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import replicate_paper as rp  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="a directory written by replicate_paper.py with a load sweep")
    p.add_argument("--policies", nargs="+", required=True)
    p.add_argument("--workloads", nargs="*", help="default: every workload of the sweep")
    p.add_argument("--batches", nargs="*", type=int, help="default: every batch of the sweep")
    args = p.parse_args(argv)

    from tangram.simulator.workload import load_workload

    out = Path(args.out)
    results = json.loads((out / "results.json").read_text())
    sweep = results["load_sweep"]
    seed = results.get("seed", 0)
    t0 = time.perf_counter()
    for name, w in sweep["workloads"].items():
        if args.workloads and name not in args.workloads:
            continue
        ran = set(w["policies"]).union(*(row["results"] for row in w["rows"]))
        unknown = [pol for pol in args.policies if pol not in ran]
        if unknown:
            p.error(f"--policies: {unknown} not in {name}'s sweep ({sorted(ran)})")
        base = load_workload(name)
        for i, row in enumerate(w["rows"]):
            if args.batches and row["batch"] not in args.batches:
                continue
            res = dict(row["results"])
            for pol in args.policies:
                rp.log(f"{name} batch {row['batch']} {pol}")
                res[pol] = rp.run(base.with_batch(row["batch"]), pol, seed)
            w["rows"][i] = rp.sweep_row(row["batch"], res)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or None
    results.setdefault("runs", []).append({"experiment": "load_sweep", "rerun_policies": args.policies,
                                           "workloads": args.workloads or sorted(sweep["workloads"]),
                                           "batches": args.batches, "seed": seed, "commit": commit,
                                           "wall_s": round(time.perf_counter() - t0, 1)})
    results["plots"] = rp.plot(results, out)
    (out / "load_sweep.md").write_text(rp.sweep_markdown(sweep))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
