#!/usr/bin/env python3
"""A digest of every scheduling decision in a few seeded simulations.

The simulator drives the real engine and policy on a virtual clock, so a seeded
run's per-action records (submit, start, end, run time, units, restore,
retries, failure) are the decisions the policy made. Two interpreters, two
builds (the policy compiled or its plain source) or two commits that print the same
digests made the same decisions, to the last bit of every float.
``scripts/check_python.sh`` compares this under another Python with the
default one; run it by hand around a change meant to keep decisions. Run an
older commit from a worktree of its own (``git worktree add``): one from before
``tangram/policy/compiled.py``'s finder, checked out in this tree, would import
the libraries built from this tree's sources and print this tree's digests.

    python scripts/decision_digest.py [--json] [RUN ...]   RUN: workload/batch[/policy]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.simulator.sim import simulate  # noqa: E402
from tangram.simulator.workload import load_workload  # noqa: E402

# every built-in workload at a batch that queues (a few seconds each), and two baselines
# that share the engine
DEFAULT_RUNS = ("ai-coding/256", "cpu-contended/256", "mopd/256", "mopd-skewed/256", "deepsearch/256",
                "mopd+search/256", "ai-coding/256/tangram:fcfs", "cpu-contended/256/fixed-dop:16")


def digest(run: str, seed: int = 0) -> str:
    parts = run.split("/")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise SystemExit(f"{run!r}: expected workload/batch[/policy]")
    policy = parts[2] if len(parts) == 3 else "tangram"
    result = simulate(load_workload(parts[0]).with_batch(int(parts[1])), policy, seed=seed)
    h = hashlib.sha256()
    for r in sorted(result.records, key=lambda r: r.id):
        # repr of a float is exact: two runs agree here only if every decision agrees
        h.update(repr((r.id, r.submit, r.start, r.end, r.run_s, r.units, r.pool_units, r.setup_s, r.restore_s,
                       r.retries, r.failed)).encode())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", default=list(DEFAULT_RUNS), metavar="RUN")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    out = {run: digest(run, args.seed) for run in args.runs}
    if args.json:
        print(json.dumps(out, indent=1, sort_keys=True))
    else:
        for run, d in out.items():
            print(f"{d}  {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
