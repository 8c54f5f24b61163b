"""The summary of a finished simulation: ACT and queue statistics, bounds, pools, classes, GPU cache."""
from __future__ import annotations

from typing import Any

import numpy as np

from tangram.simulator.bounds import memory_makespan_bound, memory_wait_bound, pooled_bound_mean


def summarize(sim: Any) -> dict[str, Any]:
    """The summary of a finished run (SimResult.summary): ACT percentiles, bounds, pools, classes."""
    recs = sim.done
    act = np.array([r.end - r.submit for r in recs]) if recs else np.zeros(1)
    queue = np.array([r.start - r.submit for r in recs]) if recs else np.zeros(1)
    execs = act - queue
    lb = np.array([r.lb for r in recs]) if recs else np.zeros(1)
    total = sim.now
    kinds = {}
    for kind in ("env", "reward"):
        sel = [i for i, r in enumerate(recs) if r.item.cls.kind == kind]
        if sel:
            kinds[kind] = {
                "actions": len(sel),
                "mean_act_s": float(act[sel].mean()),
                "mean_queue_s": float(queue[sel].mean()),
                "lower_bound_mean_act_s": float(lb[sel].mean()),
                "total_act_s_per_trajectory": float(act[sel].sum()) / max(sim.wl.trajectories * sim.wl.steps, 1),
            }
    classes = {}
    for r_i, r in enumerate(recs):
        c = classes.setdefault(r.item.cls.name, [0, 0.0, 0.0, 0.0])
        c[0] += 1
        c[1] += act[r_i]
        c[2] += r.units
        c[3] += lb[r_i]
    pools = {}
    for k, cap in sim.capacity.items():
        reserved = sim.reserved[k]
        if k == "gpu" and sim.spec.gpu_mode == "static":
            reserved = cap * total
        pools[k] = {
            "capacity": cap,
            "reserved_unit_s": round(reserved, 3),
            "busy_unit_s": round(sim.busy[k], 3),
            "reserved_frac": round(reserved / (cap * total), 4) if cap and total else 0.0,
            "utilisation": round(sim.busy[k] / (cap * total), 4) if cap and total else 0.0,
        }
        if k == "mem":  # MiB; only reserved (per trajectory), never "busy"
            pools[k]["busy_unit_s"] = pools[k]["utilisation"] = None
    out = {
        "policy": sim.spec.name,
        "workload": sim.wl.name,
        "seed": sim.seed,
        **({"replica": sim.replica} if sim.replica else {}),  # absent on the seed's own run, as stored
        "trajectories": sim.wl.trajectories,
        "steps": sim.wl.steps,
        "actions": len(recs),
        "mean_act_s": float(act.mean()),
        "p50_act_s": float(np.percentile(act, 50)),
        "p99_act_s": float(np.percentile(act, 99)),
        "mean_queue_s": float(queue.mean()),
        "mean_exec_s": float(execs.mean()),
        "mean_setup_s": float(np.mean([r.setup_s for r in recs])) if recs else 0.0,
        "mean_restore_s": float(np.mean([r.restore_s for r in recs])) if recs else 0.0,
        "step_time_s": float(np.mean(sim.step_times)) if sim.step_times else 0.0,
        "step_times_s": [round(x, 3) for x in sim.step_times],
        "job_step_time_s": {k: float(np.mean(v)) for k, v in sim.job_step_times.items()},
        "lower_bound_mean_act_s": float(lb.mean()),
        # the pooled SRPT bound (tangram.simulator.bounds) on this run's arrivals, or the above if larger
        "overload_bound_mean_act_s": max(float(lb.mean()), _pooled_bound(sim, recs)),
        "restore_share_of_exec": (float(sum(r.restore_s for r in recs) / max(sum(r.restore_s + r.run_s for r in recs), 1e-12))
                                  if recs else 0.0),
        "lower_bound_step_time_s": float(np.mean(sim.lb_step)) if sim.step_times else 0.0,
        # what any scheduler must make trajectories wait for the memory they hold (tangram.simulator.bounds)
        **_memory_bounds(sim, float(lb.sum()), len(recs)),
        "failed": sum(1 for r in recs if r.failed),
        # failed calls end early (the tool returns an error): the mean over successful ones
        "mean_act_ok_s": float(np.mean([r.end - r.submit for r in recs if not r.failed])) if recs else 0.0,
        "retries": sum(r.retries for r in recs),
        "by_kind": kinds,
        "by_class": {k: {"actions": v[0], "mean_act_s": v[1] / v[0], "mean_units": v[2] / v[0],
                         "lower_bound_mean_act_s": v[3] / v[0]} for k, v in classes.items()},
        "pools": pools,
        "scheduling_rounds": sim.engine.rounds,
        "scheduling_rounds_partial": sim.engine.rounds_partial,  # over part of the lanes (docs/scheduling.md)
        "scheduling_rounds_skipped": sim.engine.rounds_skipped,
        "restarts": sim.engine.runs_restarted,
    }
    if sim.gpu is not None:
        if sim._real_gpu:
            st = sim.gpu.stats()
            out["gpu_restores"], out["gpu_cache_hits"], out["gpu_evictions"] = st["misses"], st["hits"], st["evictions"]
            if sim._warm is not None:  # the warm start's loads are among the restores
                out["gpu_warm_loads"] = sim._warm.loads
                out["gpu_warm_gpu_s"] = round(sim._warm.gpu_s, 3)  # among the GPU pool's busy and reserved
        else:
            out["gpu_restores"], out["gpu_cache_hits"] = sim.gpu.restores, sim.gpu.hits
    return out




def _pooled_bound(sim: Any, recs) -> float:
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for r in recs:
        g = groups.setdefault(r.item.cls.rtype, ([], []))
        g[0].append(r.submit)
        g[1].append(r.work)
    return pooled_bound_mean(groups, _pooled_capacity(sim))



def _pooled_capacity(sim: Any) -> dict[str, float]:
    c = sim.wl.cluster
    cap = {k: float(v) for k, v in sim.capacity.items() if k.startswith("api:") and v}
    cap["cpu"] = float(c.total_cores)
    cap["gpu"] = float(c.total_gpus)  # the whole cluster, whatever a baseline dedicates
    return cap


def memory_slots(wl: Any) -> int:
    """Trajectories the CPU nodes' memory holds at once (the smallest reservation's count)."""
    c = wl.cluster
    sizes = [j.memory_mb for j in wl.jobs if j.memory_mb and any(cl.rtype == "cpu" for cl in j.actions + j.rewards)]
    if not sizes or not c.cpu_nodes:
        return 0
    return c.cpu_nodes * int(c.mem_gb_per_node * 1024 // min(sizes))


def _memory_bounds(sim: Any, lb_sum: float, n: int) -> dict[str, float]:
    """Mean ACT and step time no scheduler can beat, given the trajectories' memory
    reservations: each action's fastest run plus the least total wait for a memory slot."""
    slots = memory_slots(sim.wl)
    waits = sum(memory_wait_bound(r, h, slots, s0) for r, h, s0 in sim.mem_scripts)
    spans = [max(lb, memory_makespan_bound(r, h, slots, s0)) for (r, h, s0), lb in zip(sim.mem_scripts, sim.lb_step)]
    return {"memory_bound_mean_act_s": (lb_sum + waits) / n if n else 0.0,
            "memory_bound_step_time_s": float(np.mean(spans)) if spans else 0.0}

