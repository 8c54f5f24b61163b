#!/usr/bin/env python3
"""Tangram against its baselines on random workloads: what the built-in six do not cover.

    python scripts/policy_stress.py [--family cpu|gpu|api|neighbours|mixed|all] [--seeds 0:36] [--jobs 2] [--json]
                                    [--param order=fcfs ...] [--baselines-from OUT.json]
                                    [--arrival-margin S | --books B] [--generation-scale F] [--restartable]
                                    [--warm-start [all|tangram|none] | --cold-start] [--smoke]

Each seed draws one workload of a family from the ranges below (``cpu``: the
``ai-coding`` / ``cpu-contended`` kind, shell actions then an elastic test suite;
``gpu``: the ``mopd`` / ``mopd-skewed`` kind, one teacher request per trajectory;
``api``: the ``deepsearch`` kind, searches and fetches through rate-limited APIs, then
a judge on GPUs; ``neighbours``: a built-in workload with its batch, durations, turns and
nodes moved, see neighbour_workload; ``mixed``: every kind in one trajectory, shell actions
and searches, then a test suite on CPUs and a judge on GPUs, from the three families' ranges),
runs it under tangram and under the family's
baselines (the ones its built-ins compare against; a neighbour's, its built-in's), and
lists every measure (mean ACT, p99 ACT, step time) where a baseline is
more than ``--tolerance`` below tangram. A loss to a baseline that gave up on actions
(``api-naive``: a call fails after its retries) carries ``baseline_failed``, the
count: its ACT and step leave that work out. The summary gives how many workloads lose
somewhere (``losing_workloads``), to a baseline that did all its work
(``losing_like_for_like``), and to one that tangram beats on no measure (``dominated_by``
per draw, ``dominated_workloads``: a loss no other measure pays for, where the rest
trade one measure for another), and per measure the geometric mean and the largest of
tangram / the best baseline that did all its work on that draw (below 1: tangram ahead).

The ranges are not fitted to any result: each spans the built-ins' value and the
values around it a team could run (the reason beside each). The GPU baseline
``static-services`` is sized by ``mopd-skewed``'s rule (GPUs per teacher proportional
to its share of the expected work, each replica at the smallest DoP its weights fit),
so it is the strongest fixed deployment one could size knowing the mix in advance.

``--param KEY=VALUE`` (a JSON value; repeatable) runs tangram with that
``PolicyParams`` field changed, to try a policy change on the same workloads;
``--baselines-from`` an earlier ``--json`` output reuses its baselines' runs (the same
draws and simulation seed: checked) and runs tangram alone, a quarter of the time; a baseline on
tangram's GPU manager whose GPU nodes started otherwise there (an output from before the warm start
was the default counts as cold) is rerun too, on a draw with GPUs.
``--warm-start`` says which policies' GPU nodes load their models before the first request
(``tangram.managers.gpu_warm``): ``all``, the default, every policy on tangram's GPU manager, as
the service runs; ``tangram`` (or the flag alone, as before the default) tangram only; ``none``
(``--cold-start``) none.
``--arrival-margin S`` states that ``arrival_margin_s`` on every quota pool of the draws;
``--books B`` states those quota books instead (without either, the service's default,
the adaptive books: ``tangram.managers.basic``; ``--books conservative`` reruns the
first stored API runs).
``--generation-scale F`` multiplies every draw's mean generation time by F: the same
workloads under a slower (or faster) policy model. ``--restartable`` marks every elastic CPU
reward (the test suites) restartable: a straggling run may be stopped and started again
wider (``PolicyParams.restart_gain``), under tangram and every baseline that runs its CPU policy.
One seed of the simulation (``--sim-seed``) per workload: single runs at small batches
are noisy, which the counts above do not hide (read the ratios, not one point).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.policy.snapshot import PolicyParams  # noqa: E402
from tangram.simulator.policies import PolicySpec, has_warm_start, policy_spec, warm_started  # noqa: E402
from tangram.simulator.sim import simulate  # noqa: E402
from tangram.simulator.workload import parse_workload  # noqa: E402

from stress_families import (  # noqa: E402,F401  (re-exported: the tests read the families here)
    BASELINES, FAMILIES, _static_services, api_workload, builtin_names, cpu_workload, draw, gpu_workload,
    neighbour_workload,
)

MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")


def losses(res: dict[str, list[float]], tolerance: float) -> list[dict]:
    """Every (measure, baseline) where the baseline is more than ``tolerance`` below tangram."""
    t = res["tangram"]
    out = []
    for name, v in res.items():
        if name == "tangram":
            continue
        for i, m in enumerate(MEASURES):
            if v[i] > 0 and t[i] > v[i] * (1.0 + tolerance):
                out.append({"measure": m, "baseline": name, "ratio": round(t[i] / v[i], 4)})
    return out


def mark_failed(found: list[dict], failed: dict[str, int]) -> list[dict]:
    """A loss to a baseline that gave up on actions carries their count (``baseline_failed``)."""
    for loss in found:
        if loss["baseline"] in failed:
            loss["baseline_failed"] = failed[loss["baseline"]]
    return found


def dominated_by(res: dict[str, list[float]], tolerance: float, failed: dict[str, int]) -> list[str]:
    """The baselines that did all their work and beat tangram by more than ``tolerance`` on one
    measure or more while tangram beats them by more than it on none: losses no other measure of
    the same baseline pays for (a trade-off is a loss on one measure and a win on another)."""
    t = res["tangram"]
    lost_to = {x["baseline"] for x in losses(res, tolerance)}
    return [name for name, v in res.items() if name in lost_to and name not in failed
            and not any(v[i] > t[i] * (1.0 + tolerance) for i in range(len(MEASURES)))]


def summarize(rows: list[dict], tolerance: float) -> dict:
    """How many workloads lose somewhere (and to a baseline that did all its work), and tangram /
    the best baseline per measure, among the baselines that did all their work on that draw."""
    ratios = {m: [] for m in MEASURES}
    for row in rows:
        failed = row.get("failed", {})
        for i, m in enumerate(MEASURES):
            ours = row["results"]["tangram"][i]
            theirs = [v[i] for p, v in row["results"].items() if p != "tangram" and p not in failed and v[i] > 0]
            if theirs and ours > 0:
                ratios[m].append(ours / min(theirs))
    return {
        "workloads": len(rows),
        "tolerance": tolerance,
        "losing_workloads": sum(1 for row in rows if row["losses"]),
        "losing_like_for_like": sum(1 for row in rows if any("baseline_failed" not in x for x in row["losses"])),
        "dominated_workloads": sum(1 for row in rows if row.get("dominated_by")),
        "tangram_over_best": {m: {"geomean": round(statistics.geometric_mean(v), 4), "max": round(max(v), 4)}
                              for m, v in ratios.items() if v},
    }


def _run_one(job: tuple) -> dict | None:
    (family, seed, smoke, margin, books, unprofiled, steps, generation_scale, restartable, params, sim_seed, tolerance,
     stored, stored_warm, also, warm) = job
    raw = draw(family, seed, smoke, margin, books, unprofiled, steps, generation_scale, restartable)
    if raw is None:
        return None
    wl = parse_workload(raw, source=f"policy_stress {family} {seed}")
    t0 = time.perf_counter()
    results, failed = {}, {}
    names = ("tangram",) + tuple(raw["baselines"]["compare"])  # the family's (a neighbour's: its built-in's)
    ran = tuple(stored["results"]) if stored is not None else ()
    warmed = warmed_policies(names + tuple(also) + ran, warm)
    if stored is not None:  # the baselines' runs of an earlier output on this very draw (main checked)
        # a run is reused where it would run the same now: its warm start the same, or no GPU node to warm
        was = warmed_policies(ran, stored_warm)
        keep = {n for n in stored["results"]
                if n != "tangram" and ((n in warmed) == (n in was) or not wl.cluster.gpu_nodes)}
        results = {n: v for n, v in stored["results"].items() if n in keep}
        failed = {n: v for n, v in stored["failed"].items() if n in keep}
        names = tuple(n for n in names if n not in keep)
    names += tuple(n for n in also if n not in names)
    for name in names:
        s = simulate(wl, spec_of(name, params, name in warmed), seed=sim_seed).summary
        results[name] = [s[m] for m in MEASURES]
        if s["failed"]:
            failed[name] = s["failed"]  # actions it gave up on (api-naive): its ACT and step skip that work
    found = mark_failed(losses(results, tolerance), failed)
    return {"family": family, "seed": seed, "workload": raw, "results": results, "failed": failed,
            "losses": found, "dominated_by": dominated_by(results, tolerance, failed),
            "wall_s": round(time.perf_counter() - t0, 2)}


def _stored_baselines(path: str, sim_seed: int) -> tuple[dict[tuple[str, int], dict], bool | str]:
    """(family, draw) -> its row in an earlier ``--json`` output of the same simulation seed; that output's
    ``--warm-start``."""
    earlier = json.loads(Path(path).read_text())
    if earlier.get("sim_seed") != sim_seed:
        raise SystemExit(f"--baselines-from: {path} ran simulation seed {earlier.get('sim_seed')}, not {sim_seed}")
    mode = earlier.get("warm_start", False)  # outputs from before the warm start was the default ran cold
    return {(r["family"], r["seed"]): r for r in earlier["workloads"]}, mode


def spec_of(name: str, params: dict | None, warm: bool) -> PolicySpec:
    """``name``'s spec, tangram's with ``params`` (PolicyParams fields) changed; its GPU nodes' warm start
    ``warm`` where it has one."""
    spec = policy_spec(name)
    if name == "tangram" and params:
        spec = replace(spec, params=replace(spec.params, **params))
    return warm_started(spec, warm)


def warmed_policies(names: tuple[str, ...], warm: bool | str) -> set[str]:
    """The policies whose GPU nodes warm-start under ``--warm-start`` ``warm``: "all" (the default) every policy
    on tangram's GPU manager, True tangram alone, False none."""
    return {n for n in names if warm and (n == "tangram" or (warm == "all" and has_warm_start(policy_spec(n))))}


def _warm(text: str) -> str | bool:
    if text not in ("all", "tangram", "none"):
        raise argparse.ArgumentTypeError(f"expected all, tangram, none or nothing, got {text!r}")
    return {"all": "all", "tangram": True, "none": False}[text]


def _param(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or key not in PolicyParams.__dataclass_fields__:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE with a PolicyParams field, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare word: a string (order=fcfs)


def _seeds(text: str) -> range:
    a, sep, b = text.partition(":")
    try:
        seeds = range(int(a), int(b)) if sep else range(int(a), int(a) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B or N, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"no draw in {text!r}")
    return seeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES + ("neighbours", "mixed", "all"), default="all",
                    help="all: cpu, gpu and api; neighbours: the built-ins, perturbed; mixed: every kind at once")
    ap.add_argument("--seeds", type=_seeds, default=range(0, 36), help="workload draws A:B (default 0:36)")
    ap.add_argument("--sim-seed", type=int, default=0, help="the simulation's own seed")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--tolerance", type=float, default=0.01, help="a loss is a baseline this far below tangram")
    ap.add_argument("--param", type=_param, action="append", default=[], help="PolicyParams FIELD=VALUE for tangram")
    ap.add_argument("--smoke", action="store_true", help="32 trajectories a workload: checks the script runs")
    books = ap.add_mutually_exclusive_group()
    books.add_argument("--arrival-margin", type=float, metavar="S",
                       help="state this arrival_margin_s on every quota pool (every policy's managed books)")
    books.add_argument("--books", choices=("adaptive", "conservative"),
                       help="state these quota books on every quota pool (default: the service's, adaptive)")
    ap.add_argument("--unprofiled", action="store_true",
                    help="withhold every reward's profile (the scheduler learns its class from its runs)")
    ap.add_argument("--steps", type=int, help="RL steps per workload (default: the draw's, 1)")
    ap.add_argument("--generation-scale", type=float, default=1.0, metavar="F",
                    help="multiply every draw's mean generation time by F (a slower or faster policy model)")
    ap.add_argument("--restartable", action="store_true",
                    help="mark every elastic CPU reward restartable (a straggler is restarted wider)")
    ap.add_argument("--baselines-from", metavar="JSON",
                    help="an earlier --json output: reuse its baselines' runs (those that would run the same now: "
                         "their GPU nodes' warm start the same), run tangram and the rest")
    ap.add_argument("--also", action="append", default=[], metavar="POLICY",
                    help="run this baseline too on every draw (e.g. serverless:fewest); repeatable")
    start = ap.add_mutually_exclusive_group()
    start.add_argument("--warm-start", nargs="?", const=True, default="all", type=_warm, metavar="all|tangram|none",
                       help="which GPU nodes load their models before the first request (tangram.managers.gpu_warm): "
                            "all (the default) under every policy that runs tangram's GPU manager, tangram (or the "
                            "flag alone) under tangram only, none; the output's warm_start: \"all\", true or false")
    start.add_argument("--cold-start", dest="warm_start", action="store_const", const=False,
                       help="the same as --warm-start none: every GPU node loads a model when a request first needs it")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    for name in args.also:
        policy_spec(name)  # an unknown name fails here, not in a worker
    params = dict(args.param)
    PolicyParams(**params)  # a value PolicyParams refuses fails here, not in a worker
    families = FAMILIES if args.family == "all" else (args.family,)
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"--steps: must be >= 1, got {args.steps}")
    if not args.generation_scale > 0 or args.generation_scale == float("inf"):
        raise SystemExit(f"--generation-scale: must be a positive number, got {args.generation_scale}")
    if args.unprofiled or args.generation_scale != 1.0:  # refused here, not in a worker
        for f in families:
            for seed in args.seeds:
                try:
                    draw(f, seed, args.smoke, unprofiled=args.unprofiled, generation_scale=args.generation_scale)
                except ValueError as exc:
                    raise SystemExit(str(exc)) from None
    stored, stored_warm = _stored_baselines(args.baselines_from, args.sim_seed) if args.baselines_from else ({}, False)
    if args.baselines_from:
        for f in families:
            for seed in args.seeds:
                raw = draw(f, seed, args.smoke, args.arrival_margin, args.books, args.unprofiled, args.steps,
                           args.generation_scale, args.restartable)
                if raw is not None and (f, seed) not in stored:
                    raise SystemExit(f"--baselines-from: no run of {f} draw {seed} there")
                if raw is not None and stored[(f, seed)]["workload"] != raw:
                    raise SystemExit(f"--baselines-from: {f} draw {seed} there is not the workload drawn now "
                                     "(another --smoke, or the ranges changed)")
    jobs = [(f, s, args.smoke, args.arrival_margin, args.books, args.unprofiled, args.steps, args.generation_scale,
             args.restartable, params, args.sim_seed, args.tolerance, stored.get((f, s)), stored_warm, tuple(args.also),
             args.warm_start)
            for f in families for s in args.seeds]
    if args.jobs > 1:
        with Pool(args.jobs) as pool:
            rows = [r for r in pool.imap(_run_one, jobs, chunksize=1) if r is not None]  # draws vary 10x
    else:
        rows = [r for r in map(_run_one, jobs) if r is not None]
    out = {"params": params, "sim_seed": args.sim_seed, "arrival_margin_s": args.arrival_margin, "books": args.books,
           "unprofiled": args.unprofiled, "steps": args.steps, "generation_scale": args.generation_scale,
           "restartable": args.restartable, "also": args.also, "warm_start": args.warm_start,
           "summary": {f: summarize([r for r in rows if r["family"] == f], args.tolerance)
                       for f in families if any(r["family"] == f for r in rows)},
           "workloads": rows}
    if args.json:
        print(json.dumps(out))
        return 0
    for r in rows:
        if r["losses"]:
            worst = max(r["losses"], key=lambda x: x["ratio"])
            failed = f", it failed {worst['baseline_failed']} actions" if "baseline_failed" in worst else ""
            dominated = f"; ahead of {', '.join(r['dominated_by'])} on no measure" if r["dominated_by"] else ""
            print(f"{r['family']} {r['seed']:>3}: loses {len(r['losses'])} (worst {worst['measure']} "
                  f"vs {worst['baseline']} {worst['ratio']:.2f}x{failed}){dominated}")
    for f, s in out["summary"].items():
        print(f"{f}: {s['losing_workloads']} of {s['workloads']} workloads lose somewhere by > "
              f"{s['tolerance']:.0%} ({s['losing_like_for_like']} to a baseline that did all its work, "
              f"{s['dominated_workloads']} to one that tangram beats on no measure); "
              f"tangram / best such baseline: {json.dumps(s['tangram_over_best'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
