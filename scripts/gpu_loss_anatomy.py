"""Where the GPU family's losses to `static-services` come from: loading weights, not the order or the DoPs.

    python scripts/gpu_loss_anatomy.py [--sim-seed S] [--draws A,B,...] [--steps N] [--no-grid] [--json]

The GPU family of ``scripts/policy_stress.py`` (the ``mopd`` kind) has draws where tangram loses to
`static-services` on the mean or the p99 ACT and beats it on no measure. For each such draw (or each of
``--draws``) this runs, on one simulation seed:

* tangram and `static-services` as ``policy_stress.py --cold-start`` runs them (one step);
* both again with loading weights free (``restore_gbps`` 10^6 GB/s): `static-services`' replicas hold
  their weights from before the run at no cost, tangram loads each instance when a request first needs
  it, on the request's critical path;
* both over ``--steps`` steps (4 by default), each step's mean and p99 ACT: an instance stays resident
  from one step to the next, so a later step pays only the restores its own load shifts call for;
* tangram under every setting of a grid of its knobs (order and ``aging_k``, ``affinity_k``, the GPU
  offered-load factor, ``depth``; 160 settings): the best any of them reaches on that draw, and how many
  are within the tolerance of `static-services` on all three measures.

Every GPU node starts cold here (``gpu_warm`` off: each instance loaded when a request first needs it), as
it did before the warm start was the default: this is the anatomy of the cold start's losses, which the
warm start (``tangram.managers.gpu_warm``) was then built to remove.

Prints one line per draw, or one JSON object (``docs/results/policy-stress/gpu-loss-anatomy-*.json``;
``docs/results/README.md``, "GPU: what the losses to `static-services` are made of").
"""
from __future__ import annotations

import argparse
import json
import sys
from multiprocessing import Pool
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_stress import MEASURES, dominated_by, losses  # noqa: E402
from knob_grid import KNOBS, spec_for  # noqa: E402
from knob_grid import grid as knob_grid  # noqa: E402
from stress_families import draw  # noqa: E402

from tangram.simulator import simulate  # noqa: E402
from tangram.simulator.policies import policy_spec, warm_started  # noqa: E402
from tangram.simulator.workload import parse_workload  # noqa: E402

FREE_GBPS = 1e6  # loading 130 GB takes 5 us a GPU: free at the simulator's scale
BASELINE = "static-services"
GRID_KNOBS = KNOBS["gpu"]


def grid() -> list[dict]:
    return knob_grid("gpu")


def _spec(name: str, setting: dict | None = None):
    spec = spec_for(setting) if name == "tangram" else policy_spec(name)
    return warm_started(spec, False)  # the cold start's anatomy (above)


def _measures(summary: dict) -> list[float]:
    return [summary[m] for m in MEASURES]


def _per_step(result) -> list[dict]:
    """Each step's mean and p99 ACT (as the run's own summary computes them) and restores."""
    steps: dict[int, list] = {}
    for r in result.records:
        steps.setdefault(r.traj.step, []).append(r)
    out = []
    for k in sorted(steps):
        act = np.array([r.end - r.submit for r in steps[k]])
        out.append({"mean_act_s": float(act.mean()), "p99_act_s": float(np.percentile(act, 99)),
                    "restores": sum(1 for r in steps[k] if r.restore_s > 0)})
    return out


def _one(job: tuple) -> tuple:
    """One simulation: (what, draw, policy or grid index, its result)."""
    what, seed, sim_seed, name, setting, steps = job
    raw = draw("gpu", seed)
    if what == "free":
        raw["cluster"]["restore_gbps"] = FREE_GBPS
    if what == "steps":
        raw["steps"] = steps
    res = simulate(parse_workload(raw, source=f"gpu_loss_anatomy {seed}"), _spec(name, setting), seed=sim_seed)
    if what == "steps":
        return what, seed, name, _per_step(res)
    return what, seed, name if setting is None else setting, _measures(res.summary)


def _ratios(t: list[float], b: list[float]) -> list[float]:
    return [round(x / y, 4) for x, y in zip(t, b)]


def analyse(seeds: list[int], sim_seed: int, steps: int, with_grid: bool, tolerance: float, jobs: int) -> dict:
    settings = grid() if with_grid else []
    work = [(w, s, sim_seed, n, None, steps) for s in seeds for w in ("one", "free", "steps")
            for n in ("tangram", BASELINE)]
    work += [("grid", s, sim_seed, "tangram", g, steps) for s in seeds for g in settings]
    with Pool(jobs) as pool:
        done = pool.map(_one, work, chunksize=2)
    by: dict[tuple, object] = {}
    grid_runs: dict[int, list] = {s: [] for s in seeds}
    for what, seed, key, value in done:
        if what == "grid":
            grid_runs[seed].append((key, value))
        else:
            by[(what, seed, key)] = value
    rows = []
    for s in seeds:
        base = by[("one", s, BASELINE)]
        row = {"seed": s, "workload": draw("gpu", s),
               "one_step": {"tangram": by[("one", s, "tangram")], BASELINE: base},
               "free_restores": {"tangram": by[("free", s, "tangram")], BASELINE: by[("free", s, BASELINE)]},
               "per_step": [{"tangram": t, BASELINE: b}
                            for t, b in zip(by[("steps", s, "tangram")], by[("steps", s, BASELINE)])]}
        res = {"tangram": row["one_step"]["tangram"], BASELINE: base}
        row["dominated_by"] = dominated_by(res, tolerance, {})
        if settings:
            scored = sorted(((max(_ratios(v, base)), g, _ratios(v, base)) for g, v in grid_runs[s]),
                            key=lambda x: x[0])
            row["grid_best"] = {"setting": scored[0][1], "ratios": scored[0][2]}
            row["grid_within_tolerance"] = sum(1 for m, _, _ in scored if m <= 1.0 + tolerance)
        rows.append(row)
    return {"sim_seed": sim_seed, "steps": steps, "tolerance": tolerance, "free_restore_gbps": FREE_GBPS,
            "grid": {"knobs": {k: list(v) for k, v in GRID_KNOBS.items()}, "settings": len(settings)},
            "draws": rows}


def losing_draws(sim_seed: int, tolerance: float, jobs: int) -> list[int]:
    """The family's draws (0-35) where tangram loses to `static-services` and beats it on no measure."""
    work = [("one", s, sim_seed, n, None, 1) for s in range(36) if draw("gpu", s) is not None
            for n in ("tangram", BASELINE)]
    with Pool(jobs) as pool:
        done = pool.map(_one, work, chunksize=2)
    res: dict[int, dict] = {}
    for _, seed, name, v in done:
        res.setdefault(seed, {})[name] = v
    return [s for s, r in sorted(res.items()) if losses(r, tolerance) and dominated_by(r, tolerance, {})]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim-seed", type=int, default=0, help="the simulation's own seed")
    ap.add_argument("--draws", help="GPU family draws A,B,... (default: those dominated by static-services)")
    ap.add_argument("--steps", type=int, default=4, help="steps of the multi-step runs")
    ap.add_argument("--no-grid", action="store_true", help="leave out the grid of tangram's knobs")
    ap.add_argument("--tolerance", type=float, default=0.01, help="a loss is a baseline this far below tangram")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps: must be >= 2, got {args.steps}")
    if args.draws:
        seeds = [int(x) for x in args.draws.split(",")]
        missing = [s for s in seeds if draw("gpu", s) is None]
        if missing:
            raise SystemExit(f"--draws: {missing} hold no static deployment (policy_stress skips them)")
    else:
        seeds = losing_draws(args.sim_seed, args.tolerance, args.jobs)
    out = analyse(seeds, args.sim_seed, args.steps, not args.no_grid, args.tolerance, args.jobs)
    if args.json:
        print(json.dumps(out))
        return 0
    for r in out["draws"]:
        one = _ratios(r["one_step"]["tangram"], r["one_step"][BASELINE])
        free = _ratios(r["free_restores"]["tangram"], r["free_restores"][BASELINE])
        later = [_ratios([p["tangram"]["mean_act_s"], p["tangram"]["p99_act_s"]],
                         [p[BASELINE]["mean_act_s"], p[BASELINE]["p99_act_s"]]) for p in r["per_step"]]
        best = f"; best of the grid {r['grid_best']['ratios']}" if "grid_best" in r else ""
        print(f"gpu {r['seed']:>2}: tangram / {BASELINE} {one}; loading free {free}; per step (mean, p99) "
              f"{later}{best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
