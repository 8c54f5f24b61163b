#!/usr/bin/env python3
"""How far one run moves: a point's policies on several replicas, and each loss judged against the spread.

The simulator is deterministic for a seed, so the load sweep's table is one run per point, and a
close call there (tangram 0.4% above a baseline) may be a draw that the next run reverses. Each
point runs here on replicas 0 to R-1 (``tangram.simulator.replicas``: replica 0 is the stored
run; replica r moves every generation gap by under 5 ms either way, the same for every policy),
for tangram and each baseline named. A point is a load sweep's ``--point WORKLOAD:BATCH:SEED`` (a
built-in or a YAML file, the simulation's seed) or a random draw of ``scripts/policy_stress.py``,
``--draw FAMILY:DRAW:SIM_SEED``, drawn as that script draws it by default: the service's default
quota books (its stored ``api-adaptive-books-*.json``, ``mixed-*.json`` and the CPU and GPU parts
of ``sim-seed-*.json``, whose API part has ``--books conservative``). Per baseline and measure
(mean ACT, p99 ACT, step time), against tangram:

* ``verdict``: tangram's replicas' min..max against the baseline's, as the demo judges its
  repeats (``tangram.demo.results.judge``): "better" or "worse" when they do not overlap,
  else "within noise";
* ``paired``: on how many replicas tangram's value is at or below the baseline's on the same
  replica (the same perturbed work), and the median of tangram / baseline over the replicas.

``--param FIELD=VALUE`` (as ``policy_stress.py``'s) runs tangram with that ``PolicyParams`` field
changed, to judge a policy change against the baselines' noise.

A baseline that failed calls on some replica (``api-naive`` gives up after its retries) is
marked: its short ACTs are work it dropped. ``--json`` prints one object, every replica's
measures included (``runs``, replica 0 first); without it, a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # stress_families, when loaded from a file by the tests

from tangram.core.errors import TangramError  # noqa: E402
from tangram.demo.results import judge  # noqa: E402
from tangram.simulator.policies import PolicySpec, policy_spec  # noqa: E402
from tangram.simulator.sim import Simulation  # noqa: E402
from tangram.simulator.workload import load_workload, parse_workload  # noqa: E402

from policy_stress import _param, spec_of  # noqa: E402
from stress_families import DRAW, draw  # noqa: E402

MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")


def parse_point(text: str) -> tuple[str, int, int]:
    """``WORKLOAD:BATCH:SEED`` (the workload may itself hold a colon-free path or built-in name)."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"a point is WORKLOAD:BATCH:SEED, got {text!r}")
    try:
        batch, seed = int(parts[1]), int(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(f"BATCH and SEED must be whole numbers, got {text!r}") from None
    if batch < 1 or seed < 0:
        raise argparse.ArgumentTypeError(f"BATCH must be 1 or more and SEED 0 or more, got {text!r}")
    return parts[0], batch, seed


def parse_draw(text: str) -> tuple[str, str, int, int]:
    """``FAMILY:DRAW:SIM_SEED`` -> ("draw", family, draw, sim_seed)."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in DRAW:
        raise argparse.ArgumentTypeError(f"a draw is FAMILY:DRAW:SIM_SEED with FAMILY one of {sorted(DRAW)}, got {text!r}")
    try:
        seed, sim_seed = int(parts[1]), int(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(f"DRAW and SIM_SEED must be whole numbers, got {text!r}") from None
    if seed < 0 or sim_seed < 0:
        raise argparse.ArgumentTypeError(f"DRAW and SIM_SEED must be 0 or more, got {text!r}")
    return "draw", parts[0], seed, sim_seed


def _workload(point: tuple):
    """The point's workload and the simulation's seed."""
    if point[0] == "draw":
        _, family, seed, sim_seed, books = point
        raw = draw(family, seed, books=books)
        if raw is None:
            raise SystemExit(f"noise_spread: {family} draw {seed} is skipped by its family (see policy_stress.py)")
        return parse_workload(raw, source=f"policy_stress {family} {seed}"), sim_seed
    workload, batch, seed = point
    return load_workload(workload).with_batch(batch), seed


def _spec(policy: str, params: tuple, warm: bool = True) -> PolicySpec:
    """``policy`` as named, tangram with ``params`` (FIELD, VALUE) pairs changed; ``warm`` False: GPU nodes on
    tangram's GPU manager start cold (``--cold-start``)."""
    return spec_of(policy, dict(params), warm)


def _one(task: tuple) -> tuple[tuple, dict]:
    point, policy, replica, params, warm = task
    wl, seed = _workload(point)
    s = Simulation(wl, _spec(policy, params, warm), seed=seed, replica=replica).run().summary
    return task[:3], {**{m: s[m] for m in MEASURES}, "failed": s["failed"]}


def _describe(point: tuple) -> dict:
    if point[0] == "draw":
        return {"family": point[1], "draw": point[2], "sim_seed": point[3], "books": point[4] or "default"}
    return {"workload": point[0], "batch": point[1], "seed": point[2]}


def _spread(runs: list[dict]) -> dict:
    out: dict = {m: statistics.median(r[m] for r in runs) for m in MEASURES}
    out["spread"] = {m: [min(r[m] for r in runs), max(r[m] for r in runs)] for m in MEASURES}
    out["runs"] = runs
    out["failed"] = [r["failed"] for r in runs]
    return out


def compare_point(runs: dict[str, list[dict]], reference: str = "tangram") -> dict:
    """Per baseline and measure: the verdict over the replicas' spreads and the paired count.
    ``runs``: policy -> its replicas' measures, in replica order (the same replicas for all)."""
    ref = _spread(runs[reference])
    out: dict = {}
    for name, rs in runs.items():
        if name == reference:
            continue
        other = _spread(rs)
        per: dict = {}
        for m in MEASURES:
            ratios = [a[m] / b[m] for a, b in zip(runs[reference], rs) if b[m] > 0]
            per[m] = {"verdict": judge(ref, other, m),
                      "paired_at_or_below": sum(a[m] <= b[m] for a, b in zip(runs[reference], rs)),
                      "median_ratio": round(statistics.median(ratios), 4) if ratios else None}
        out[name] = {"measures": per, "failed_calls": any(other["failed"])}
    return out


def _summary(policy_runs: list[dict]) -> dict:
    s = _spread(policy_runs)
    return {m: {"median": round(s[m], 4), "min": round(s["spread"][m][0], 4), "max": round(s["spread"][m][1], 4)}
            for m in MEASURES} | {"failed": s["failed"], "runs": [[r[m] for m in MEASURES] for r in policy_runs]}


def run_points(points: list[tuple], replicas: int, policies: list[str] | None, jobs: int = 1,
               params: dict | None = None, warm: bool = True) -> list[dict]:
    """``points``: ``(WORKLOAD, BATCH, SEED)`` or ``("draw", FAMILY, DRAW, SIM_SEED, BOOKS)`` (BOOKS None:
    the service's default); ``params``: PolicyParams fields changed for tangram."""
    pairs = tuple(sorted((params or {}).items()))
    if pairs:
        _spec("tangram", pairs)  # an unknown field fails before any run
    named = {}
    for pt in points:
        wl, _ = _workload(pt)
        names = policies or [p for p in wl.baselines.compare if p != "tangram"]
        for n in names:
            policy_spec(n)  # an unknown name fails before any run
        named[pt] = ["tangram", *[n for n in names if n != "tangram"]]
    tasks = [(pt, p, r, pairs, warm) for pt, names in named.items() for p in names for r in range(replicas)]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as ex:
            done = dict(ex.map(_one, tasks))
    else:
        done = dict(map(_one, tasks))
    out = []
    for pt, names in named.items():
        runs = {p: [done[(pt, p, r)] for r in range(replicas)] for p in names}
        out.append({**_describe(pt), "replicas": replicas, **({"params": dict(pairs)} if pairs else {}),
                    **({} if warm else {"warm_start": False}),
                    "policies": {p: _summary(rs) for p, rs in runs.items()},
                    "against": compare_point(runs)})
    return out


def _table(results: list[dict]) -> str:
    lines = ["| point | baseline | mean ACT | p99 ACT | step |", "| --- | --- | --- | --- | --- |"]
    short = {"better": "lower", "worse": "higher", "within noise": "noise", "equal": "equal", "one run": "one run"}
    for res in results:
        for name, cmp in res["against"].items():
            cells = []
            for m in MEASURES:
                c = cmp["measures"][m]
                cells.append(f"{short[c['verdict']]} ({c['paired_at_or_below']}/{res['replicas']}, "
                             f"{c['median_ratio']})")
            tag = " (failed calls)" if cmp["failed_calls"] else ""
            where = (f"{res['family']} draw {res['draw']} s{res['sim_seed']}" if "family" in res
                     else f"{res['workload']} {res['batch']} s{res['seed']}")
            lines.append(f"| {where} | {name}{tag} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", type=parse_point, action="append", default=[], metavar="WORKLOAD:BATCH:SEED",
                    help="a point of the load sweep (repeatable)")
    ap.add_argument("--draw", type=parse_draw, action="append", default=[], metavar="FAMILY:DRAW:SIM_SEED",
                    help="a draw of scripts/policy_stress.py (repeatable)")
    ap.add_argument("--replicas", type=int, default=6, help="replicas 0..R-1 per policy (0: the sweep's run)")
    ap.add_argument("--policies", nargs="+", help="baselines (default: each workload's compared policies)")
    ap.add_argument("--param", type=_param, action="append", default=[], metavar="FIELD=VALUE",
                    help="a PolicyParams field for tangram (repeatable)")
    ap.add_argument("--books", choices=("adaptive", "conservative"),
                    help="a --draw's quota books, as policy_stress.py --books (default: the service's)")
    ap.add_argument("--cold-start", action="store_true",
                    help="GPU nodes on tangram's GPU manager load a model when a request first needs it (the "
                         "default warm-starts them, gpu_nodes[].warm_start); the point's warm_start: false")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.replicas < 2:
        ap.error("--replicas must be 2 or more: one run has no spread")
    if not args.point and not args.draw:
        ap.error("give at least one --point or --draw")
    if args.jobs < 1:
        ap.error(f"--jobs must be 1 or more, got {args.jobs}")
    try:
        _spec("tangram", tuple(args.param))
    except ValueError as exc:  # a value PolicyParams refuses
        ap.error(f"--param: {exc}")
    try:
        results = run_points(args.point + [(*d, args.books) for d in args.draw], args.replicas, args.policies,
                             args.jobs, dict(args.param), warm=not args.cold_start)
    except TangramError as exc:  # an unknown workload or policy, a workload file that does not parse
        ap.error(str(exc))
    if args.json:
        print(json.dumps({"replicas": args.replicas, "points": results}, indent=1))
    else:
        print(_table(results))
        print(f"\nverdict over {args.replicas} replicas' min..max (lower/higher: tangram's; noise: they overlap); "
              "(k/R, r): tangram at or below on k replicas, median tangram / baseline r")
    return 0


if __name__ == "__main__":
    sys.exit(main())
