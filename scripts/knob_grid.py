"""Does any setting of tangram's knobs reach the baselines that dominate it on a random family's draws?

    python scripts/knob_grid.py --family cpu --stored docs/results/policy-stress/sim-seed-0.json [--json]

``scripts/policy_stress.py`` names, per draw, the baselines tangram beats on no measure by more than
the tolerance (``dominated_by``). For each such draw of a stored ``--json`` run (or each of
``--draws``), this runs tangram under every setting of a grid of its knobs for the family and
reports the setting closest to those baselines (the smallest largest ratio over the three measures
and the dominating baselines), how many settings come within the tolerance of all of them, and how
many are at or below every baseline of the draw that did all its work (the target, on that draw).
The draws and the baselines' results are the stored run's; the simulation seed is its own.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from multiprocessing import Pool
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_stress import MEASURES  # noqa: E402
from stress_families import draw  # noqa: E402

from tangram.policy.snapshot import DEFAULT_OFFERED_LOAD_CAPS  # noqa: E402
from tangram.simulator import simulate  # noqa: E402
from tangram.simulator.policies import policy_spec  # noqa: E402
from tangram.simulator.workload import parse_workload  # noqa: E402

# [reason] each knob on the family's path at its default and on both sides of it. GPU: the order (FCFS,
# the aging window's k), the affinity window, the GPU offered-load cap's factor (0: off), the look-ahead
# depth. CPU: the order, the depth and the look-ahead's length, the expected arrivals (off, or expected
# after the mean gap or the residual one), the offered-load cap on CPU pools too (0: off, as by default)
KNOBS = {
    "gpu": {"order": (("fcfs", 4.0), ("aging", 1.0), ("aging", 4.0), ("aging", 16.0)),
            "affinity_k": (0.0, 1.0, 4.0, 16.0), "gpu_factor": (0.0, 0.25, 0.5, 1.0, 2.0), "depth": (2, 3)},
    "cpu": {"order": (("fcfs", 4.0), ("aging", 1.0), ("aging", 4.0), ("aging", 16.0)),
            "depth": (2, 3), "lookahead": (8, 32),
            "arrivals": ((False, "mean"), (True, "mean"), (True, "residual")), "cpu_factor": (0.0, 0.5, 1.0)},
}


def grid(family: str) -> list[dict]:
    knobs = KNOBS[family]
    out = []
    for values in itertools.product(*knobs.values()):
        setting = dict(zip(knobs, values))
        order = setting.pop("order")
        setting["order"], setting["aging_k"] = order
        if "arrivals" in setting:
            setting["expect_arrivals"], setting["arrival_gap"] = setting.pop("arrivals")
        out.append(setting)
    return out


def spec_for(setting: dict | None):
    """tangram's policy under ``setting`` (``gpu_factor`` / ``cpu_factor``: the offered-load cap's
    factor on that type, 0 off; the other keys are PolicyParams fields)."""
    spec = policy_spec("tangram")
    if not setting:
        return spec
    p = dict(setting)
    caps = dict(DEFAULT_OFFERED_LOAD_CAPS)
    for rtype in ("gpu", "cpu"):
        factor = p.pop(f"{rtype}_factor", None)
        if factor is not None:
            caps.pop(rtype, None)
            if factor:
                caps[rtype] = factor
    p["offered_load_caps"] = MappingProxyType(caps)
    return replace(spec, params=replace(spec.params, **p))


def _run(job: tuple) -> tuple:
    family, seed, sim_seed, i, setting = job
    s = simulate(parse_workload(draw(family, seed), source=f"knob_grid {family} {seed}"), spec_for(setting),
                 seed=sim_seed).summary
    return seed, i, [s[m] for m in MEASURES]


def _largest(t: list[float], names, results: dict) -> float:
    return max(t[k] / results[n][k] for n in names for k in range(len(MEASURES)) if results[n][k] > 0)


def search(family: str, rows: list[dict], sim_seed: int, tolerance: float, jobs: int) -> dict:
    settings = grid(family)
    work = [(family, r["seed"], sim_seed, i, g) for r in rows for i, g in enumerate(settings)]
    with Pool(jobs) as pool:
        done = pool.map(_run, work, chunksize=4)
    runs: dict[int, dict[int, list[float]]] = {}
    for seed, i, v in done:
        runs.setdefault(seed, {})[i] = v
    out = []
    for r in rows:
        res = {n: v for n, v in r["results"].items() if n != "tangram"}
        dominating = r["dominated_by"]
        complete = [n for n in res if n not in r["failed"]]  # the baselines that did all their work
        scored = sorted((_largest(v, dominating, res), i) for i, v in runs[r["seed"]].items())
        best, i = scored[0]
        out.append({"seed": r["seed"], "dominated_by": dominating, "tangram": r["results"]["tangram"],
                    "best_setting": settings[i], "best": runs[r["seed"]][i],
                    "best_ratio": round(best, 4),
                    "within_tolerance": sum(1 for x, _ in scored if x <= 1.0 + tolerance),
                    "at_or_below_every_baseline": sum(
                        1 for v in runs[r["seed"]].values() if _largest(v, complete, res) <= 1.0 + tolerance)})
    return {"family": family, "sim_seed": sim_seed, "tolerance": tolerance,
            "knobs": {k: list(v) for k, v in KNOBS[family].items()}, "settings": len(settings), "draws": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(KNOBS), required=True)
    ap.add_argument("--stored", required=True, help="a policy_stress.py --json output holding the family's draws")
    ap.add_argument("--draws", help="draws A,B,... (default: every draw of the family that a baseline dominates)")
    ap.add_argument("--tolerance", type=float, default=0.01, help="a loss is a baseline this far below tangram")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    stored = json.loads(Path(args.stored).read_text())
    if stored.get("params"):  # its tangram is not the one the grid's default is
        raise SystemExit("--stored: a run with tangram's settings changed (--param)")
    if args.family == "gpu" and stored.get("warm_start", False) != "all":  # its baselines ran another warm start
        raise SystemExit("--stored: a GPU run from before the warm start was the default (or --warm-start "
                         "tangram / none): rerun it with policy_stress.py's default")
    rows = [r for r in stored["workloads"] if r["family"] == args.family]
    if args.draws:
        want = {int(x) for x in args.draws.split(",")}
        rows = [r for r in rows if r["seed"] in want]
        missing = want - {r["seed"] for r in rows}
        if missing:
            raise SystemExit(f"--draws: {sorted(missing)} not in {args.stored}")
        if any(not r["dominated_by"] for r in rows):
            raise SystemExit("--draws: a draw no baseline dominates has nothing to reach")
    else:
        rows = [r for r in rows if r["dominated_by"]]
    for r in rows:
        if r["workload"] != draw(args.family, r["seed"]):
            raise SystemExit(f"--stored: {args.family} draw {r['seed']} there is not the workload drawn now")
    out = search(args.family, rows, stored["sim_seed"], args.tolerance, args.jobs)
    if args.json:
        print(json.dumps(out))
        return 0
    for d in out["draws"]:
        print(f"{args.family} {d['seed']:>2}: default {d['tangram']}, closest to {', '.join(d['dominated_by'])}: "
              f"{d['best_ratio']}x ({d['best_setting']}); {d['within_tolerance']} of {out['settings']} settings "
              f"reach it, {d['at_or_below_every_baseline']} every baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
