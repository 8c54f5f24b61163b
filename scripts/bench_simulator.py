#!/usr/bin/env python
"""How fast the simulator runs: actions simulated per second of wall time.

    python scripts/bench_simulator.py [--workload ai-coding] [--batch 2048] [--policy tangram] [--json]
    python scripts/bench_simulator.py --all [--batch N] [--json]   # every built-in workload x its policies

Default: ai-coding at batch 2,048 on the paper's 15 x 256 cores (~100k actions).
With ``--all``: every built-in workload at its own default batch (or ``--batch``),
under tangram and every baseline it is compared with; one JSON object with ``runs``.
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
    p.add_argument("--all", action="store_true", help="every built-in workload under tangram and its baselines")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from tangram.simulator.workload import builtin_names, load_workload

    if args.all:
        runs = []
        explicit = "--batch" in (argv if argv is not None else sys.argv[1:])
        for name in builtin_names():
            wl = load_workload(name)
            wl = wl.with_batch(args.batch) if explicit else wl
            for policy in ["tangram", *wl.baselines.compare]:
                runs.append(_run(wl, policy, args.seed, False))
                if not args.json:
                    print(" ".join(f"{k}={v}" for k, v in runs[-1].items()), flush=True)
        if args.json:
            print(json.dumps({"runs": runs}))
        return 0
    out = _run(load_workload(args.workload).with_batch(args.batch), args.policy, args.seed, args.profile)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>18}: {v}")
    return 0


def _run(wl, policy: str, seed: int, profile: bool) -> dict:
    from tangram.simulator.sim import Simulation

    sim = Simulation(wl, policy, seed=seed)
    prof = None
    if profile:
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
    return {
        "workload": wl.name,
        "policy": policy,
        "batch": wl.trajectories,
        "actions": s["actions"],
        "scheduling_rounds": s["scheduling_rounds"],
        "scheduling_rounds_partial": s["scheduling_rounds_partial"],
        "wall_s": round(wall, 3),
        "actions_per_s": round(s["actions"] / wall, 1),
        "rounds_per_s": round(s["scheduling_rounds"] / wall, 1),
        "us_per_round": round(1e6 * wall / max(s["scheduling_rounds"], 1), 1),
        "mean_act_s": s["mean_act_s"],
    }


if __name__ == "__main__":
    sys.exit(main())
