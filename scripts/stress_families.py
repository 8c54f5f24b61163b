"""The random workload families of scripts/policy_stress.py: what each draws, and from which ranges.

    python scripts/stress_families.py FAMILY SEED [--smoke]   # print that draw, as the workload schema

Each range holds the built-ins' value and the values around it a team could run, the reason
beside each; nothing is fitted to a result (the runner's docstring says how they are used).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.simulator.workload import GPU_DOPS, builtin_names, builtin_raw  # noqa: E402

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
# the baselines' settings every family that has them shares (copied into each draw)
TRAJECTORY_PODS = {"pod_cores": 4, "start_s": 5.0, "start_per_concurrent_s": 0.02}  # as the built-ins
SERVERLESS = {"load_gbps": 5}  # as mopd and deepsearch: NVMe loading per GPU
# as deepsearch: a 429 in 0.1 s, backoff from 1 s to 30 s, six retries
API_NAIVE = {"reject_s": 0.1, "backoff_s": 1.0, "backoff_max_s": 30.0, "max_retries": 6}


def _models(sizes: list[float]) -> dict:
    """Services of ``sizes`` GB, named t0, t1, ... (_static_services deploys them by these names);
    mopd's rule for their requests' length: prefill time ~ parameters, t1_scale = size / 60 GB."""
    return {f"t{i}": {"size_gb": float(s), "t1_scale": round(s / 60, 3)} for i, s in enumerate(sizes)}


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
            "trajectory": dict(TRAJECTORY_PODS),
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
    services = _models(sizes)
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
        "baselines": {"static_services": static, "serverless": dict(SERVERLESS),
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
            "serverless": dict(SERVERLESS),
            "api_naive": dict(API_NAIVE),
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


def mixed_workload(seed: int, smoke: bool = False) -> dict:
    """One random workload whose trajectories use every kind of resource: a coding agent's shell
    actions and web searches, then its test suite on CPUs and a judge model on GPUs. The ranges are
    the three families' own but for the judges' count and the searches' share (the reason beside each)."""
    # apart from the cpu, gpu and api families' draws, but the same stream as the neighbours' (a slip the
    # stored runs were drawn with, kept so that they reproduce): the two families read it for different
    # things, so a mixed draw and a neighbour of the same seed share numbers, not a workload
    r = random.Random(30_000 + seed)
    # [reason] the gpu family's model sizes; one judge to three (the api family has one, the gpu family
    # 2-8 teachers: a coding job's judges are fewer)
    sizes = [r.choice(TEACHER_SIZES_GB) for _ in range(r.choice([1, 2, 3]))]
    nodes = r.choice([1, 2])  # [reason] the gpu family's smaller clusters: the GPUs serve only the judge
    judges = _models(sizes)
    static = _static_services(sizes, nodes * 8)
    w = r.choice([0.2, 0.5])  # [reason] searches as a fifth or a half of a coding agent's tool calls
    return {
        "name": f"stress-mixed-{seed}",
        "trajectories": 32 if smoke else r.choice([64, 128, 256, 512]),  # [reason] as the cpu family
        "steps": 1,
        "turns": {"dist": "lognormal", "mean": r.choice([5, 10, 20]), "cv": 0.5, "min": 1, "max": 100},  # as cpu
        # [reason] the cpu family's and the api family's generation times
        "generation_s": {"dist": "lognormal", "mean": r.choice([1.0, 3.0, 8.0, 16.0]), "cv": 0.8},
        "memory_mb": r.choice([4096, 8192, 16384]),  # [reason] as the cpu family
        "env_start_s": 1.0,  # [guess] as the built-ins
        "actions": {
            "shell": {"weight": 1.0 - w,
                      # [reason] as the cpu family's shell actions
                      "duration_s": {"dist": "lognormal", "mean": r.choice([0.3, 1.0, 2.0, 5.0]),
                                     "cv": r.choice([0.5, 1.5])},
                      "resources": {"cpu": 1}, "profiled": r.choice([False, True])},
            "search": {"weight": w,
                       # [reason] as the api family's searches
                       "duration_s": {"dist": "lognormal", "mean": r.choice([0.5, 1.0, 2.0]), "cv": 0.5},
                       "resources": {"api:search": 1}},
        },
        "rewards": {
            "test-suite": {  # [reason] as the cpu family's suites
                "duration_s": {"dist": "lognormal", "mean": r.choice([10.0, 30.0, 120.0, 300.0]),
                               "cv": r.choice([0.5, 1.0]), "max": 3600},
                "resources": {"cpu": {"min": 1, "max": r.choice([8, 16, 32, 64])}},
                "elasticity": {"amdahl": r.choice([0.01, 0.05, 0.2, 0.5])},
                "profiled": True,
            },
            "judge": {  # [reason] as the gpu family's teachers: one of the judges scores each trajectory
                "duration_s": {"dist": "lognormal", "mean": r.choice([1.0, 4.0, 10.0]), "cv": 0.6},
                "resources": {"gpu": list(GPU_DOPS)},
                "elasticity": {"amdahl": r.choice([0.05, 0.1, 0.3])},
                "service": list(judges),
                "profiled": True,
            },
        },
        "services": judges,
        "cluster": {
            "cpu_nodes": r.choice([1, 2, 4]),  # [reason] as the cpu family
            "cores_per_node": r.choice([32, 64, 128]),  # [reason] as the cpu family
            "mem_gb_per_node": r.choice([256, 512, 1024]),  # [reason] as the cpu family
            "gpu_nodes": nodes, "gpus_per_node": 8, "gpu_mem_gb": GPU_MEM_GB, "restore_gbps": 25,  # as gpu
            # [reason] as the api family's search API
            "api": {"search": {"concurrency": r.choice([16, 64]), "quota": r.choice([10, 50]), "period_s": 1.0}},
        },
        "baselines": {
            "trajectory": dict(TRAJECTORY_PODS),
            **({"static_services": static} if static is not None else {}),
            "serverless": dict(SERVERLESS),
            "api_naive": dict(API_NAIVE),
            # every family's baselines; static-services only where one replica of each judge fits
            "compare": list(dict.fromkeys(b for fam in FAMILIES for b in BASELINES[fam]
                                          if b != "static-services" or static is not None)),
        },
    }


DRAW = {"cpu": cpu_workload, "gpu": gpu_workload, "api": api_workload, "neighbours": neighbour_workload,
        "mixed": mixed_workload}


def draw(family: str, seed: int, smoke: bool = False, arrival_margin_s: float | None = None,
         books: str | None = None, unprofiled: bool = False, steps: int | None = None,
         generation_scale: float = 1.0, restartable: bool = False) -> dict | None:
    """Draw ``seed`` of ``family``; ``arrival_margin_s`` states that margin on every quota pool (the
    managed books free a call's slot that long after its dispatch instead of after its answer; the
    simulated upstream counts a call at its dispatch either way), ``books`` those books; ``unprofiled``
    withholds every reward's profile (the scheduler learns it from runs), ``steps`` sets the steps,
    ``generation_scale`` multiplies the mean generation time (a slower or faster policy model),
    ``restartable`` marks every elastic CPU reward (a test suite) restartable (Action.restartable)."""
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
    if raw is not None and restartable:
        for job in raw.get("jobs") or [raw]:
            for cls in job.get("rewards", {}).values():
                if isinstance(cls["resources"].get("cpu"), dict):  # a {min, max} range: elastic
                    cls["restartable"] = True  # the name stays: the same random streams, the same draw
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
    return {name: {"dop": d, "replicas": n} for name, d, n in zip(_models(sizes), dops, replicas)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Print one draw of a family (the YAML schema of tangram/workloads, as JSON).")
    ap.add_argument("family", choices=sorted(DRAW))
    ap.add_argument("seed", type=int)
    ap.add_argument("--smoke", action="store_true", help="32 trajectories, as policy_stress.py --smoke")
    args = ap.parse_args(argv)
    raw = DRAW[args.family](args.seed, args.smoke)
    if raw is None:  # a gpu draw whose static deployment cannot hold one replica of every teacher
        raise SystemExit(f"{args.family} draw {args.seed}: skipped (no static deployment holds every model)")
    print(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
