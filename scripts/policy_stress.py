#!/usr/bin/env python3
"""Tangram against its baselines on random workloads: what the built-in six do not cover.

    python scripts/policy_stress.py [--family cpu|gpu|api|neighbours|all] [--seeds 0:36] [--jobs 2] [--json]
                                    [--param order=fcfs ...] [--baselines-from OUT.json]
                                    [--arrival-margin S | --books B] [--generation-scale F] [--smoke]

Each seed draws one workload of a family from the ranges below (``cpu``: the
``ai-coding`` / ``cpu-contended`` kind, shell actions then an elastic test suite;
``gpu``: the ``mopd`` / ``mopd-skewed`` kind, one teacher request per trajectory;
``api``: the ``deepsearch`` kind, searches and fetches through rate-limited APIs, then
a judge on GPUs; ``neighbours``: a built-in workload with its batch, durations, turns and
nodes moved, see neighbour_workload), runs it under tangram and under the family's
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
draws and simulation seed: checked) and runs tangram alone, a quarter of the time.
``--arrival-margin S`` states that ``arrival_margin_s`` on every quota pool of the draws;
``--books B`` states those quota books instead (without either, the service's default,
the adaptive books: ``tangram.managers.basic``; ``--books conservative`` reruns the
first stored API runs).
``--generation-scale F`` multiplies every draw's mean generation time by F: the same
workloads under a slower (or faster) policy model.
One seed of the simulation (``--sim-seed``) per workload: single runs at small batches
are noisy, which the counts above do not hide (read the ratios, not one point).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.policy.snapshot import PolicyParams  # noqa: E402
from tangram.simulator.policies import policy_spec  # noqa: E402
from tangram.simulator.sim import simulate  # noqa: E402
from tangram.simulator.workload import GPU_DOPS, builtin_names, builtin_raw, parse_workload  # noqa: E402

MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")
FAMILIES = ("cpu", "gpu", "api")
BASELINES = {  # as the built-ins of each family compare (tangram/workloads/*.yaml, baselines.compare)
    "cpu": ("trajectory", "fixed-dop:1", "fixed-dop:4", "fixed-dop:16"),
    "gpu": ("static-services", "serverless"),
    "api": ("api-naive", "api-retry", "static-services", "serverless"),
}
GPU_MEM_GB = 80  # [bench] Hopper-class 80 GB, as every built-in GPU workload
# [reason] mopd-skewed's replicas "at the smallest DoP its weights fit comfortably" put 29-35 GB of
# weights on a GPU and not 65.6 GB (its 32B teacher at DoP 1) or 70.6 GB (its 70B at DoP 2): any limit
# from 35.3 GB up to 65.6 GB gives its table; half of 80 GB, the rest for the KV cache and activations
STATIC_WEIGHTS_SHARE = 0.5
TEACHER_SIZES_GB = (15, 30, 60, 130)  # [public] ~7B, 14B, 32B and 70B models in bf16, as mopd-skewed's range


def cpu_workload(seed: int, smoke: bool = False) -> dict:
    """One random workload of the ai-coding kind (the YAML schema of tangram/workloads)."""
    r = random.Random(seed)
    batch = 32 if smoke else r.choice([64, 128, 256, 512])  # [reason] light to overloaded on the nodes below
    return {
        "name": f"stress-cpu-{seed}", "trajectories": batch, "steps": 1,
        # [reason] around ai-coding's 48 and cpu-contended's 20 turns, shorter and longer (cv, min and
        # max as cpu-contended's)
        "turns": {"dist": "lognormal", "mean": r.choice([5, 10, 20, 40]), "cv": 0.5, "min": 1, "max": 100},
        # [reason] around the built-ins' 3 s: a fast policy model to a long-thinking one
        "generation_s": {"dist": "lognormal", "mean": r.choice([0.5, 1.0, 3.0, 8.0]), "cv": 0.8},
        "memory_mb": r.choice([4096, 8192, 16384]),  # [reason] the built-ins' 8 and 16 GiB, and half of 8
        "env_start_s": 1.0,  # [guess] as the built-ins
        "actions": {"shell": {
            "weight": 1.0,
            # [reason] around the built-ins' 2 s (cv 1.5): quick commands to builds; a narrower spread too
            "duration_s": {"dist": "lognormal", "mean": r.choice([0.3, 1.0, 2.0, 5.0]), "cv": r.choice([0.5, 1.5])},
            "resources": {"cpu": 1},
            "profiled": r.choice([False, True]),  # [reason] the built-ins' False, and a profiled one
        }},
        "rewards": {"test-suite": {
            # [reason] around the built-ins' 120 s: small suites to long ones
            # cv: [reason] the built-ins' 1.0, and suites of more even length
            "duration_s": {"dist": "lognormal", "mean": r.choice([10.0, 30.0, 120.0, 300.0]),
                           "cv": r.choice([0.5, 1.0]), "max": 3600},  # max: as the built-ins
            # [reason] the built-ins' 64, and suites with fewer tests to spread over
            "resources": {"cpu": {"min": 1, "max": r.choice([8, 16, 32, 64])}},
            # [reason] around the built-ins' 0.05: near-perfectly parallel to half serial
            "elasticity": {"amdahl": r.choice([0.01, 0.05, 0.2, 0.5])},
            "profiled": True,  # [paper §A4] rewards are profiled
        }},
        "cluster": {
            "cpu_nodes": r.choice([1, 2, 4]),  # [reason] cpu-contended's 4 nodes, and smaller clusters
            "cores_per_node": r.choice([32, 64, 128]),  # [reason] cpu-contended's 128, and smaller nodes
            "mem_gb_per_node": r.choice([256, 512, 1024]),  # [reason] around cpu-contended's 512 GB
        },
        "baselines": {
            "trajectory": {"pod_cores": 4, "start_s": 5.0, "start_per_concurrent_s": 0.02},  # as the built-ins
            "compare": list(BASELINES["cpu"]),
        },
    }


def gpu_workload(seed: int, smoke: bool = False) -> dict | None:
    """One random workload of the mopd kind, or None when the static deployment cannot hold
    one replica of every teacher (the draw is skipped: no baseline to compare with)."""
    r = random.Random(10_000 + seed)  # apart from the CPU family's draws
    nodes = r.choice([1, 2, 3])  # [reason] mopd-skewed's 3 nodes, and smaller clusters
    # [reason] around mopd's 9 teachers and mopd-skewed's 5
    sizes = [r.choice(TEACHER_SIZES_GB) for _ in range(r.choice([2, 3, 5, 8]))]
    # [reason] mopd's rule: prefill time ~ parameters, t1_scale = size / 60 GB
    services = {f"t{i}": {"size_gb": float(s), "t1_scale": round(s / 60, 3)} for i, s in enumerate(sizes)}
    static = _static_services(sizes, nodes * 8)
    if static is None:
        return None
    batch = 32 if smoke else r.choice([128, 256, 512, 1024])  # [reason] light to overloaded on the GPUs above
    return {
        "name": f"stress-gpu-{seed}", "trajectories": batch, "steps": 1, "turns": 0,
        # [reason] mopd's 60 s, and a policy model three times faster
        "generation_s": {"dist": "lognormal", "mean": r.choice([20.0, 60.0]), "cv": 1.0},
        "rewards": {"teacher": {
            # [reason] around mopd's 4 s at 60 GB: shorter and longer trajectories to score
            "duration_s": {"dist": "lognormal", "mean": r.choice([1.0, 4.0, 10.0]), "cv": 0.6},
            "resources": {"gpu": list(GPU_DOPS)},
            "elasticity": {"amdahl": r.choice([0.05, 0.1, 0.3])},  # [reason] around mopd's 0.1
            "service": list(services),
            "profiled": True,  # [paper §A4] as mopd
        }},
        "services": services,
        # [bench] 8 GPUs of 80 GB a node, restores at 25 GB/s per GPU: as mopd
        "cluster": {"gpu_nodes": nodes, "gpus_per_node": 8, "gpu_mem_gb": GPU_MEM_GB, "restore_gbps": 25},
        "baselines": {"static_services": static, "serverless": {"load_gbps": 5},  # as mopd
                      "compare": list(BASELINES["gpu"])},
    }


def api_workload(seed: int, smoke: bool = False) -> dict:
    """One random workload of the deepsearch kind: searches and page fetches through rate-limited
    APIs, then a judge model on GPUs."""
    r = random.Random(20_000 + seed)  # apart from the other families' draws
    nodes = r.choice([1, 2, 5])  # [reason] deepsearch's 5 nodes, and smaller clusters
    return {
        "name": f"stress-api-{seed}",
        "trajectories": 32 if smoke else r.choice([128, 256, 512, 1024]),  # [reason] light to overloaded APIs
        "steps": 1,
        # [reason] around deepsearch's 12 turns and 8 s of reasoning between calls
        "turns": {"dist": "lognormal", "mean": r.choice([6, 12, 24]), "cv": 0.7, "min": 1, "max": 100},
        "generation_s": {"dist": "lognormal", "mean": r.choice([2.0, 8.0, 16.0]), "cv": 0.8},
        "actions": {
            # [reason] deepsearch's 0.6 / 0.4 mix, and one of more fetches than searches
            "search": {"weight": (w := r.choice([0.6, 0.3])),
                       # [reason] around deepsearch's 1 s search latency (cv as deepsearch's)
                       "duration_s": {"dist": "lognormal", "mean": r.choice([0.5, 1.0, 2.0]), "cv": 0.5},
                       "resources": {"api:search": 1}},
            "fetch": {"weight": round(1.0 - w, 3),
                      # [reason] around deepsearch's 3 s page fetch (cv as deepsearch's)
                      "duration_s": {"dist": "lognormal", "mean": r.choice([1.0, 3.0, 6.0]), "cv": 0.8},
                      "resources": {"api:fetch": 1}},
        },
        "rewards": {"judge": {
            "duration_s": {"dist": "lognormal", "mean": 12.0, "cv": 0.5},  # [guess] as deepsearch
            "resources": {"gpu": list(GPU_DOPS)},
            "elasticity": {"amdahl": 0.15},  # [guess] as deepsearch
            "service": "judge", "profiled": True,
        }},
        "services": {"judge": {"size_gb": 65}},  # [bench] as deepsearch (gpt-oss-120b in MXFP4)
        "cluster": {
            "gpu_nodes": nodes, "gpus_per_node": 8, "gpu_mem_gb": GPU_MEM_GB, "restore_gbps": 25,  # as deepsearch
            "api": {
                # [reason] around deepsearch's 64 concurrent / 50 per second (period as its) and 32
                # concurrent fetches
                "search": {"concurrency": r.choice([16, 64]), "quota": r.choice([10, 50]), "period_s": 1.0},
                "fetch": {"concurrency": r.choice([8, 32, 64])},
            },
        },
        "baselines": {
            "static_services": {"judge": {"dop": 8, "replicas": nodes}},  # as deepsearch: a replica per node
            "serverless": {"load_gbps": 5},
            # as deepsearch: a 429 in 0.1 s, backoff from 1 s to 30 s, six retries
            "api_naive": {"reject_s": 0.1, "backoff_s": 1.0, "backoff_max_s": 30.0, "max_retries": 6},
            "compare": list(BASELINES["api"]),
        },
    }


# [reason] halved, as built, doubled: around each built-in, as far as the other families' ranges go
NEIGHBOUR_FACTORS = (0.5, 1, 2)


def _half_up(x: float) -> int:
    return max(1, int(x + 0.5))


def neighbour_workload(seed: int, smoke: bool = False) -> dict:
    """One built-in workload (draw ``seed`` takes the built-ins in turn) with its batch drawn and
    its action durations, generation time, turns (mean and cap) and nodes each halved, kept or
    doubled. The static deployment is scaled with the nodes; where it no longer fits,
    ``static-services`` leaves the draw's baselines. A job of several workloads (``mopd+search``)
    moves its batch and nodes only."""
    names = builtin_names()
    name = names[seed % len(names)]
    raw = builtin_raw(name)
    r = random.Random(30_000 + seed)  # apart from the other families' draws
    # [reason] the load sweep's batches up to 1,024 (its 2,048 and 4,096 take minutes a draw), and 128
    batch = r.choice([128, 256, 512, 1024])
    fa, fg, ft, fc = (r.choice(NEIGHBOUR_FACTORS) for _ in range(4))
    if smoke:
        batch = 32  # the full draw's factors, at a smoke test's size
    if "jobs" in raw:
        fa = fg = ft = 1
        for job in raw["jobs"]:
            job["trajectories"] = batch  # each job's batch, as the load sweep's Workload.with_batch
            # a job's random streams follow its name: one per draw, as a single job's follow the workload's
            job["name"] = f"{job.get('name', job['workload'])}-{seed}"
    else:
        raw["trajectories"] = batch
    for section in ("actions", "rewards"):
        for cls in raw.get(section, {}).values():
            cls["duration_s"] = _scaled(cls["duration_s"], fa)
    if "generation_s" in raw:
        raw["generation_s"] = _scaled(raw["generation_s"], fg)
    if isinstance(raw.get("turns"), dict):
        turns = raw["turns"]
        raw["turns"] = {**turns, "mean": _half_up(turns["mean"] * ft), "max": _half_up(turns["max"] * ft)}
    cluster, base = raw["cluster"], raw["baselines"]
    for key in ("cpu_nodes", "gpu_nodes"):
        if cluster.get(key):
            cluster[key] = _half_up(cluster[key] * fc)
    static = base.get("static_services")
    if static:
        for replica in static.values():
            replica["replicas"] = _half_up(replica["replicas"] * fc)
        gpus = cluster.get("gpu_nodes", 0) * cluster.get("gpus_per_node", 0)
        if sum(v["dop"] * v["replicas"] for v in static.values()) > gpus:
            del base["static_services"]
            base["compare"] = [b for b in base["compare"] if b != "static-services"]
    raw["name"] = f"{name}~a{fa}g{fg}t{ft}c{fc}-{seed}"
    return raw


def _scaled(dist: dict, factor: float) -> dict:
    out = {**dist, "mean": dist["mean"] * factor}
    if "max" in out:
        out["max"] = out["max"] * factor
    return out


DRAW = {"cpu": cpu_workload, "gpu": gpu_workload, "api": api_workload, "neighbours": neighbour_workload}


def draw(family: str, seed: int, smoke: bool = False, arrival_margin_s: float | None = None,
         books: str | None = None, unprofiled: bool = False, steps: int | None = None,
         generation_scale: float = 1.0) -> dict | None:
    """Draw ``seed`` of ``family``; ``arrival_margin_s`` states that margin on every quota pool (the
    managed books free a call's slot that long after its dispatch instead of after its answer; the
    simulated upstream counts a call at its dispatch either way), ``books`` those books; ``unprofiled``
    withholds every reward's profile (the scheduler learns it from runs), ``steps`` sets the steps,
    ``generation_scale`` multiplies the mean generation time (a slower or faster policy model)."""
    raw = DRAW[family](seed, smoke)
    if raw is not None and (unprofiled or generation_scale != 1.0) and "jobs" in raw:
        what = "--unprofiled" if unprofiled else "--generation-scale"
        raise ValueError(f"{what}: {raw['name']} is a job of several workloads, each with its own definition")
    if raw is not None and unprofiled:
        for cls in raw["rewards"].values():
            cls["profiled"] = False
    if raw is not None and generation_scale != 1.0:
        raw["generation_s"] = _scaled(raw["generation_s"], generation_scale)
        raw["name"] += f"-generation-x{generation_scale:g}"
    if raw is not None and steps is not None:
        raw["steps"] = steps
    stated = {k: v for k, v in (("arrival_margin_s", arrival_margin_s), ("books", books)) if v is not None}
    if raw is not None and stated:
        for pool in raw["cluster"].get("api", {}).values():
            if "quota" in pool:
                pool.update(stated)
    return raw


def _static_services(sizes: list[float], gpus: int) -> dict | None:
    """mopd-skewed's rule: one replica of each teacher at the smallest DoP its weights fit
    comfortably (STATIC_WEIGHTS_SHARE of each GPU), then replicas to the teacher furthest below its
    share of the expected work (equal request rates x t1_scale, so a share ~ its size) while one fits,
    and past the shares until no GPU that could hold one is left (mopd-skewed leaves one idle)."""
    dops = [next((d for d in GPU_DOPS if s / d <= GPU_MEM_GB * STATIC_WEIGHTS_SHARE), None) for s in sizes]
    if None in dops or sum(dops) > gpus:
        return None
    replicas = [1] * len(sizes)
    left = gpus - sum(dops)
    total = sum(sizes)
    while True:
        # past every share too: a GPU left idle serves nobody, a replica more never slows a teacher
        gaps = [(gpus * s / total - d * n, i) for i, (s, d, n) in enumerate(zip(sizes, dops, replicas)) if d <= left]
        if not gaps:
            break
        _, i = max(gaps)
        replicas[i] += 1
        left -= dops[i]
    return {f"t{i}": {"dop": d, "replicas": n} for i, (d, n) in enumerate(zip(dops, replicas))}


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
    family, seed, smoke, margin, books, unprofiled, steps, generation_scale, params, sim_seed, tolerance, stored = job
    raw = draw(family, seed, smoke, margin, books, unprofiled, steps, generation_scale)
    if raw is None:
        return None
    wl = parse_workload(raw, source=f"policy_stress {family} {seed}")
    t0 = time.perf_counter()
    results, failed = {}, {}
    names = ("tangram",) + tuple(raw["baselines"]["compare"])  # the family's (a neighbour's: its built-in's)
    if stored is not None:  # the baselines' runs of an earlier output on this very draw (main checked)
        results = {n: v for n, v in stored["results"].items() if n != "tangram"}
        failed = {n: v for n, v in stored["failed"].items() if n != "tangram"}
        names = ("tangram",)
    for name in names:
        spec = policy_spec(name)
        if name == "tangram" and params:
            spec = replace(spec, params=replace(spec.params, **params))
        s = simulate(wl, spec, seed=sim_seed).summary
        results[name] = [s[m] for m in MEASURES]
        if s["failed"]:
            failed[name] = s["failed"]  # actions it gave up on (api-naive): its ACT and step skip that work
    found = mark_failed(losses(results, tolerance), failed)
    return {"family": family, "seed": seed, "workload": raw, "results": results, "failed": failed,
            "losses": found, "dominated_by": dominated_by(results, tolerance, failed),
            "wall_s": round(time.perf_counter() - t0, 2)}


def _stored_baselines(path: str, sim_seed: int) -> dict[tuple[str, int], dict]:
    """(family, draw) -> its row in an earlier ``--json`` output of the same simulation seed."""
    earlier = json.loads(Path(path).read_text())
    if earlier.get("sim_seed") != sim_seed:
        raise SystemExit(f"--baselines-from: {path} ran simulation seed {earlier.get('sim_seed')}, not {sim_seed}")
    return {(r["family"], r["seed"]): r for r in earlier["workloads"]}


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
    ap.add_argument("--family", choices=FAMILIES + ("neighbours", "all"), default="all",
                    help="all: cpu, gpu and api; neighbours: the built-ins, perturbed")
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
    ap.add_argument("--baselines-from", metavar="JSON",
                    help="an earlier --json output: reuse its baselines' runs, run tangram alone")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
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
    stored = _stored_baselines(args.baselines_from, args.sim_seed) if args.baselines_from else {}
    if args.baselines_from:
        for f in families:
            for seed in args.seeds:
                raw = draw(f, seed, args.smoke, args.arrival_margin, args.books, args.unprofiled, args.steps,
                           args.generation_scale)
                if raw is not None and (f, seed) not in stored:
                    raise SystemExit(f"--baselines-from: no run of {f} draw {seed} there")
                if raw is not None and stored[(f, seed)]["workload"] != raw:
                    raise SystemExit(f"--baselines-from: {f} draw {seed} there is not the workload drawn now "
                                     "(another --smoke, or the ranges changed)")
    jobs = [(f, s, args.smoke, args.arrival_margin, args.books, args.unprofiled, args.steps, args.generation_scale,
             params, args.sim_seed, args.tolerance, stored.get((f, s)))
            for f in families for s in args.seeds]
    if args.jobs > 1:
        with Pool(args.jobs) as pool:
            rows = [r for r in pool.imap(_run_one, jobs, chunksize=1) if r is not None]  # draws vary 10x
    else:
        rows = [r for r in map(_run_one, jobs) if r is not None]
    out = {"params": params, "sim_seed": args.sim_seed, "arrival_margin_s": args.arrival_margin, "books": args.books,
           "unprofiled": args.unprofiled, "steps": args.steps, "generation_scale": args.generation_scale,
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
