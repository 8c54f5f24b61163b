#!/usr/bin/env python
"""How fast the simulator runs: actions simulated per second of wall time.

    python scripts/bench_simulator.py [--workload ai-coding] [--batch 2048] [--policy tangram] [--json]

Default: ai-coding at batch 2,048 on the paper's 15 x 256 cores (~100k actions).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="ai-coding")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--policy", default="tangram")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="print the top of a cProfile of the run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from tangram.simulator.sim import Simulation
    from tangram.simulator.workload import load_workload

    wl = load_workload(args.workload).with_batch(args.batch)
    sim = Simulation(wl, args.policy, seed=args.seed)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    res = sim.run()
    wall = time.perf_counter() - t0
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    s = res.summary
    out = {
        "workload": wl.name,
        "policy": args.policy,
        "batch": args.batch,
        "actions": s["actions"],
        "scheduling_rounds": s["scheduling_rounds"],
        "wall_s": round(wall, 3),
        "actions_per_s": round(s["actions"] / wall, 1),
        "rounds_per_s": round(s["scheduling_rounds"] / wall, 1),
        "us_per_round": round(1e6 * wall / max(s["scheduling_rounds"], 1), 1),
        "mean_act_s": s["mean_act_s"],
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>18}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
