"""Project the measured rollout to a cluster the user names, on the simulator (clearly simulated).

The simulator runs the real engine and policy on a virtual clock. Every input of the
projected workload comes from this demo's measurements or its own generator:

* shell action durations: the measured exec times of every shell action in every run
  (a lognormal of their mean and coefficient of variation);
* reward duration at DoP 1: the median measured reward exec time at DoP 1 (the baselines
  with 1-core pods), else T1 of the profile store the demo used;
* reward elasticity: the profile store's Amdahl serial fraction (measured by ``tangram
  profile``; ``--calibrate`` measures it on this machine), unless the user gives one;
* LLM gaps and turns: the demo's own generator (uniform 0.5..1.5 x --gap-s, --turns);
* environment start: the measured time to set a trajectory's environment up;
* cluster: nodes of up to 256 cores (the paper's CPU nodes), memory never the limit.

Ray tasks are projected as ``fixed-dop:N``: action-level placement with the reward at
the fixed DoP N, which is what fixed ``num_cpus`` gives.
"""
from __future__ import annotations

import json
import math
import statistics
from typing import Any, Mapping

from tangram.demo.results import HEADLINE

NODE_CORES = 256  # [paper §A4] 256-core CPU nodes
# when the suite does not scale where it was measured: the built-in ai-coding workload's guess for a
# pytest-xdist suite on real cores (tangram/workloads/ai-coding.yaml, [guess]), shown as a second scenario
SCALING_SERIAL_FRACTION = 0.05


def _lognormal(xs: list[float]) -> dict[str, Any]:
    mean = statistics.fmean(xs)
    cv = statistics.pstdev(xs) / mean if len(xs) > 1 and mean > 0 else 0.0
    return {"dist": "lognormal", "mean": round(max(mean, 1e-3), 4), "cv": round(max(cv, 0.01), 3)}


def profile_elasticity(profile_path: str, cls: str) -> tuple[float | None, float | None]:
    """(T1, Amdahl serial fraction) of ``cls`` in a profile store, each None when absent."""
    with open(profile_path) as f:
        c = json.load(f)["classes"].get(cls, {})
    return c.get("t1_s"), c.get("serial_fraction")


def inputs(spec, runs: Mapping[str, list], profile_path: str, reward_class: str,
           serial_fraction: float | None = None) -> dict[str, Any]:
    """The measured inputs of the projection (see the module doc), each with its source."""
    shells = [s.exec_s for rs in runs.values() for r in rs for s in r.samples if s.kind == "shell" and s.ok]
    rewards1 = [s.exec_s for rs in runs.values() for r in rs for s in r.samples
                if s.kind == "reward" and s.ok and s.dop == 1]
    setups = [x for rs in runs.values() for r in rs for x in getattr(r, "setup_s", [])]
    t1_profile, serial_profile = profile_elasticity(profile_path, reward_class)
    if rewards1:
        t1, t1_src = statistics.median(rewards1), f"median of {len(rewards1)} measured rewards at DoP 1"
    else:
        t1, t1_src = t1_profile or 1.0, f"T1 of {profile_path}"
    if serial_fraction is not None:
        serial, serial_src = serial_fraction, "given (--project-serial-fraction)"
    else:
        serial, serial_src = (serial_profile if serial_profile is not None else 1.0), f"Amdahl fit in {profile_path}"
    return {
        "shell_s": _lognormal(shells or [0.1]), "shell_source": f"{len(shells)} measured shell actions",
        "reward_t1_s": round(t1, 3), "reward_t1_source": t1_src,
        "serial_fraction": round(serial, 4), "serial_fraction_source": serial_src,
        "gap_s": [round(0.5 * spec.gap_s, 3), round(1.5 * spec.gap_s, 3)], "turns": spec.turns,
        "env_start_s": round(statistics.median(setups), 3) if setups else 0.1,
    }


def workload(inp: Mapping[str, Any], *, cores: int, trajectories: int, pod_cores: int) -> dict[str, Any]:
    nodes = max(1, math.ceil(cores / NODE_CORES))
    per_node = math.ceil(cores / nodes)
    gap_lo, gap_hi = inp["gap_s"]
    return {
        "name": "demo-coding-projection", "trajectories": trajectories, "steps": 1, "turns": inp["turns"],
        "generation_s": {"dist": "uniform", "low": gap_lo, "high": gap_hi} if gap_hi > 0 else 0.001,
        "memory_mb": 256, "env_start_s": inp["env_start_s"],
        "actions": {"shell": {"duration_s": inp["shell_s"], "resources": {"cpu": 1}}},
        "rewards": {"test-suite": {
            "duration_s": {"dist": "lognormal", "mean": inp["reward_t1_s"], "cv": 0.05},  # cv: run-to-run [guess]
            "resources": {"cpu": {"min": 1, "max": min(64, per_node)}},
            "elasticity": {"amdahl": inp["serial_fraction"]}, "profiled": True}},
        "cluster": {"cpu_nodes": nodes, "cores_per_node": per_node,
                    "mem_gb_per_node": max(64, math.ceil(trajectories * 256 / 1024 / nodes) * 2)},
        "baselines": {"trajectory": {"pod_cores": pod_cores, "start_s": inp["env_start_s"]}},
    }


def project(inp: Mapping[str, Any], *, cores: int, trajectories: int, pod_cores: int, ray_dop: int | None,
            seed: int = 0, scaling_scenario: bool = False) -> dict[str, Any]:
    """The projection with the measured inputs; with ``scaling_scenario`` and a measured serial fraction
    above 0.5 (no speedup where it was measured), also ``if_scaling``: the same with
    :data:`SCALING_SERIAL_FRACTION`, labelled as the guess it is."""
    out = _project(inp, cores=cores, trajectories=trajectories, pod_cores=pod_cores, ray_dop=ray_dop, seed=seed)
    if scaling_scenario and inp["serial_fraction"] > 0.5:
        alt = {**inp, "serial_fraction": SCALING_SERIAL_FRACTION,
               "serial_fraction_source": "a guess: tangram/workloads/ai-coding.yaml's for a pytest-xdist suite "
                                         "on cores that scale"}
        # a baseline whose reward runs at DoP 1 does not see the elasticity: its simulation is the same
        same = {n: p for n, p in out["policies"].items() if n != "tangram" and pod_cores == 1}
        out["if_scaling"] = _project(alt, cores=cores, trajectories=trajectories, pod_cores=pod_cores,
                                     ray_dop=ray_dop, seed=seed, known=same)
    return out


def _project(inp: Mapping[str, Any], *, cores: int, trajectories: int, pod_cores: int, ray_dop: int | None,
             seed: int, known: Mapping[str, Any] | None = None) -> dict[str, Any]:
    from tangram.simulator import simulate
    from tangram.simulator.workload import parse_workload

    wl = parse_workload(workload(inp, cores=cores, trajectories=trajectories, pod_cores=pod_cores))
    names = {"tangram": "tangram"}
    if ray_dop is not None:
        names["ray-tasks"] = f"fixed-dop:{ray_dop}"
    names["trajectory"] = "trajectory"
    policies = {}
    for shown, sim_name in names.items():
        if known and shown in known:
            policies[shown] = dict(known[shown])
            continue
        s = simulate(wl, sim_name, seed=seed).summary
        policies[shown] = {k: round(s[k], 3) for k in HEADLINE} | {"simulated_as": sim_name}
    ref = policies["tangram"]
    ratios = {n: {short: round(p[k] / ref[k], 3) if ref[k] > 0 else None for k, short in HEADLINE.items()}
              for n, p in policies.items() if n != "tangram"}
    c = wl.cluster
    return {"simulated": True, "cores": c.cpu_nodes * c.cores_per_node, "cpu_nodes": c.cpu_nodes,
            "trajectories": trajectories, "seed": seed, "inputs": dict(inp), "policies": policies, "ratios": ratios}
