"""What real CPU accounting costs against plain counters (the simulator's choice, docs/architecture.md).

    python3 scripts/bench_managers.py [--n 100000] [--repeats 5] [--cores 64]

Allocates ``--n`` grants of 4 cores on one node (two NUMA domains), 16 held
at a time, with ``CpuManager`` (concrete NUMA-aware core sets) and with
``CountingManager`` (counts only), interleaved, and prints JSON: median,
min and max seconds per run for each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.core.model import Action  # noqa: E402
from tangram.managers.base import CountingManager  # noqa: E402
from tangram.managers.cpu import CpuManager, CpuNode  # noqa: E402

HELD = 16
UNITS = 4


def run(manager, n: int) -> float:
    actions = [Action.build(f"a{i}", {"cpu": UNITS}) for i in range(64)]
    t0 = time.perf_counter()
    for i in range(n):
        manager.allocate("cpu@n0", UNITS, f"h{i % HELD}", actions[i % 64])
        if i % HELD == HELD - 1:
            for k in range(HELD):
                manager.release("cpu@n0", f"h{k}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cores", type=int, default=64)
    args = ap.parse_args()
    half = args.cores // 2
    numa = (tuple(range(half)), tuple(range(half, args.cores)))
    samples: dict[str, list[float]] = {"cpu_manager": [], "counting_manager": []}
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        samples["cpu_manager"].append(run(CpuManager([CpuNode("n0", tuple(range(args.cores)), numa=numa,
                                                              memory_mb=1 << 20)]), args.n))
        samples["counting_manager"].append(run(CountingManager({"cpu@n0": args.cores}), args.n))
    out = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for k, v in samples.items()}
    out["ratio_of_medians"] = out["cpu_manager"]["median_s"] / out["counting_manager"]["median_s"]
    print(json.dumps({"n": args.n, "repeats": args.repeats, "cores": args.cores, **out}))


if __name__ == "__main__":
    main()
