#!/usr/bin/env python
"""Reproduce the *shape* of the paper's evaluation with the simulator.

    python scripts/replicate_paper.py [--quick] [--out DIR] [--seed N] [--only NAME ...]

Experiments (paper numbers in brackets, for comparison only; nothing is tuned
to them, the ratios below are whatever the simulation gives):

* ``cpu_scaling``  mean ACT vs batch size, ai-coding, tangram vs trajectory
                   (Kubernetes pods) [3.1x .. 27.7x lower ACT, batch 256..2048]
* ``ablation``     elastic vs fixed-dop:1/4/16 at batch 1,280 [3.0x vs DoP 16]
* ``gpu_scaling``  mean ACT vs batch, mopd, tangram vs static-services (SGLang)
                   and serverless (ServerlessLLM) [18.1x vs SGLang at 2,048],
                   and the GPU count at which tangram matches static-services'
                   ACT on the full cluster [29% of the GPUs]
* ``breakdown``    ai-coding action time split into environment interaction
                   and reward, tangram vs trajectory [9.0x, 2.8x, total 4.3x]
* ``end_to_end``   every built-in workload under its compared policies (step
                   time speed-ups) [ai-coding 1.4x, deepsearch 1.5x]
* ``load_sweep``   every built-in workload from light load to overload (batch
                   256 .. 4,096): tangram against every baseline (and against
                   its own FCFS order) on mean ACT, p99 ACT and step time, with
                   both lower bounds; every point where a baseline beats
                   tangram on a measure is listed under ``losses``

Every result carries the lower bound (each action at its fastest feasible
allocation, never queued, no restore or set-up), the overload-aware bound
(``tangram.simulator.bounds``: SRPT on one pooled machine per resource type)
and the memory bound (the least wait for the sandboxes' memory slots), so the
distance to the limit is visible at every load. Writes ``results.json`` and one PNG per experiment into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PAPER = {
    "cpu_scaling": "3.1x to 27.7x lower mean ACT than Kubernetes, batch 256..2048",
    "ablation": "3.0x lower ACT than fixed DoP 16 at batch 1280",
    "gpu_scaling": "18.1x faster than SGLang at batch 2048; same ACT with 29% of the GPUs",
    "breakdown": "environment interaction 9.0x, reward 2.8x, total ACT 4.3x (ai-coding)",
    "end_to_end": "step time 1.4x (ai-coding), 1.5x (deepsearch)",
    "load_sweep": "(not in the paper: tangram vs every baseline from light load to overload)",
}
MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")

KEEP = ("policy", "workload", "trajectories", "actions", "mean_act_s", "p50_act_s", "p99_act_s", "mean_queue_s",
        "mean_exec_s", "mean_setup_s", "mean_restore_s", "step_time_s", "job_step_time_s", "lower_bound_mean_act_s",
        "lower_bound_step_time_s", "failed", "retries", "by_kind", "pools", "gpu_restores", "gpu_cache_hits",
        "overload_bound_mean_act_s", "memory_bound_mean_act_s", "memory_bound_step_time_s", "restore_share_of_exec",
        "gpu_warm_loads")  # the last: the GPU nodes' warm start, where one ran (a run without it has none)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(wl, policy: str, seed: int) -> dict:
    from tangram.simulator.sim import simulate

    t0 = time.perf_counter()
    s = simulate(wl, policy, seed=seed).summary
    out = {k: s[k] for k in KEEP if k in s}
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    log(f"  {wl.name:<12} batch {wl.trajectories:>5} {policy:<16} mean ACT {s['mean_act_s']:8.2f} s "
        f"(lower bound {s['lower_bound_mean_act_s']:.2f})  step {s['step_time_s']:7.0f} s  [{out['wall_s']} s]")
    return out


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b > 0 else None


# --------------------------------------------------------------------------- #


def cpu_scaling(cfg, seed):
    from tangram.simulator.workload import load_workload

    base = load_workload("ai-coding")
    rows = []
    for b in cfg["cpu_batches"]:
        wl = base.with_batch(b)
        t, k = run(wl, "tangram", seed), run(wl, "trajectory", seed)
        rows.append({"batch": b, "tangram": t, "trajectory": k,
                     "act_ratio": ratio(k["mean_act_s"], t["mean_act_s"]),
                     "step_ratio": ratio(k["step_time_s"], t["step_time_s"]),
                     "lower_bound_mean_act_s": t["lower_bound_mean_act_s"]})
    return {"paper": PAPER["cpu_scaling"], "rows": rows}


def ablation(cfg, seed):
    from tangram.simulator.workload import load_workload

    wl = load_workload("ai-coding").with_batch(cfg["ablation_batch"])
    res = {p: run(wl, p, seed) for p in ("tangram", "fixed-dop:1", "fixed-dop:4", "fixed-dop:16")}
    t = res["tangram"]["mean_act_s"]
    reward = {p: r["by_kind"].get("reward", {}).get("mean_act_s") for p, r in res.items()}
    return {"paper": PAPER["ablation"], "batch": cfg["ablation_batch"], "results": res,
            "act_ratio_vs_tangram": {p: ratio(r["mean_act_s"], t) for p, r in res.items()},
            "reward_act_ratio_vs_tangram": {p: ratio(v, reward["tangram"]) for p, v in reward.items() if v},
            "lower_bound_mean_act_s": res["tangram"]["lower_bound_mean_act_s"]}


def gpu_scaling(cfg, seed):
    from tangram.simulator.workload import load_workload

    base = load_workload("mopd")
    rows = []
    for b in cfg["gpu_batches"]:
        wl = base.with_batch(b)
        r = {p: run(wl, p, seed) for p in ("tangram", "static-services", "serverless")}
        rows.append({"batch": b, **r,
                     "act_ratio_static": ratio(r["static-services"]["mean_act_s"], r["tangram"]["mean_act_s"]),
                     "act_ratio_serverless": ratio(r["serverless"]["mean_act_s"], r["tangram"]["mean_act_s"]),
                     "lower_bound_mean_act_s": r["tangram"]["lower_bound_mean_act_s"]})
    # GPU count at which tangram matches static-services on the full cluster
    counts = [_gpu_count(base, b, cfg["gpu_shapes"], seed) for b in cfg["gpu_count_batches"]]
    return {"paper": PAPER["gpu_scaling"], "rows": rows, "gpu_count": counts}


def _gpu_count(base, b, shapes, seed):
    from tangram.simulator.errors import WorkloadError

    wl = base.with_batch(b)
    target = run(wl, "static-services", seed)
    # what static-services' replicas hold (the ratio's denominator), not the cluster (mopd leaves 4 idle)
    full = sum(dop * replicas for dop, replicas in wl.baselines.static.values()) or wl.cluster.total_gpus
    sweep = []
    for nodes, per in shapes:
        try:
            small = wl.with_cluster(replace(wl.cluster, gpu_nodes=nodes, gpus_per_node=per))
        except WorkloadError as exc:  # a teacher does not fit this shape at all
            sweep.append({"gpus": nodes * per, "nodes": nodes, "gpus_per_node": per, "infeasible": str(exc)})
            continue
        r = run(small, "tangram", seed)
        sweep.append({"gpus": nodes * per, "nodes": nodes, "gpus_per_node": per, "mean_act_s": r["mean_act_s"],
                      "lower_bound_mean_act_s": r["lower_bound_mean_act_s"], "step_time_s": r["step_time_s"]})
    ok = [s for s in sweep if "mean_act_s" in s and s["mean_act_s"] <= target["mean_act_s"]]
    match = min((s["gpus"] for s in ok), default=None)
    return {"batch": b, "static_services_gpus": full, "cluster_gpus": wl.cluster.total_gpus,
            "static_services_mean_act_s": target["mean_act_s"],
            "sweep": sweep, "tangram_matching_gpus": match,
            "fraction_of_gpus": (round(match / full, 3) if match else None)}


def breakdown(cfg, seed):
    from tangram.simulator.workload import load_workload

    wl = load_workload("ai-coding").with_batch(cfg["breakdown_batch"])
    t, k = run(wl, "tangram", seed), run(wl, "trajectory", seed)
    out = {"paper": PAPER["breakdown"], "batch": cfg["breakdown_batch"], "tangram": {}, "trajectory": {}, "ratio": {}}
    for name, r in (("tangram", t), ("trajectory", k)):
        for kind in ("env", "reward"):
            out[name][kind] = r["by_kind"][kind]
        out[name]["total_act_s_per_trajectory"] = sum(r["by_kind"][x]["total_act_s_per_trajectory"] for x in ("env", "reward"))
        out[name]["mean_act_s"] = r["mean_act_s"]
    for kind in ("env", "reward"):
        out["ratio"][kind] = ratio(k["by_kind"][kind]["total_act_s_per_trajectory"], t["by_kind"][kind]["total_act_s_per_trajectory"])
    out["ratio"]["total"] = ratio(out["trajectory"]["total_act_s_per_trajectory"], out["tangram"]["total_act_s_per_trajectory"])
    out["ratio"]["mean_act"] = ratio(k["mean_act_s"], t["mean_act_s"])
    out["lower_bound"] = {kind: t["by_kind"][kind]["lower_bound_mean_act_s"] for kind in ("env", "reward")}
    return out


def end_to_end(cfg, seed):
    from tangram.simulator.workload import load_workload

    out = {"paper": PAPER["end_to_end"], "workloads": {}}
    for name in ("ai-coding", "deepsearch", "mopd", "mopd+search"):
        wl = load_workload(name).with_batch(cfg["e2e_batch"])
        pols = ["tangram"] + [p for p in wl.baselines.compare if not p.startswith("fixed-dop")]
        res = {p: run(wl, p, seed) for p in pols}
        t = res["tangram"]
        out["workloads"][name] = {
            "batch": cfg["e2e_batch"], "results": res,
            "act_ratio": {p: ratio(r["mean_act_s"], t["mean_act_s"]) for p, r in res.items()},
            "step_ratio": {p: ratio(r["step_time_s"], t["step_time_s"]) for p, r in res.items()},
            "lower_bound_mean_act_s": t["lower_bound_mean_act_s"],
            "lower_bound_step_time_s": t["lower_bound_step_time_s"],
        }
    return out


def load_sweep(cfg, seed):
    from tangram.policy.snapshot import PolicyParams
    from tangram.simulator.workload import builtin_names, load_workload

    own_fcfs = [] if PolicyParams().order == "fcfs" else ["tangram:fcfs"]
    out = {"paper": PAPER["load_sweep"], "measures": list(MEASURES), "workloads": {}}
    for name in cfg["sweep_workloads"] or builtin_names():
        base = load_workload(name)
        pols = ["tangram", *own_fcfs, *base.baselines.compare]
        rows = []
        for b in cfg["sweep_batches"]:
            rows.append(sweep_row(b, {p: run(base.with_batch(b), p, seed) for p in pols}))
        out["workloads"][name] = {"policies": pols, "rows": rows}
    return out


def sweep_row(batch: int, res: dict) -> dict:
    """One batch of a load sweep: every policy's results, tangram's losses and its bounds."""
    t = res["tangram"]
    # a baseline that failed calls (api-naive gives up after its retries) ends those actions and their
    # trajectories early: its loss entries say how many, so a win by dropping work reads as one
    losses = [{"policy": p, "measure": m, "tangram": t[m], "baseline": r[m], "ratio": ratio(t[m], r[m]),
               "baseline_failed": r.get("failed", 0)}
              for p, r in res.items() if p != "tangram" for m in MEASURES if r[m] < t[m] * (1 - 1e-6)]
    return {"batch": batch, "results": res, "losses": losses,
            "lower_bound_mean_act_s": t["lower_bound_mean_act_s"],
            "overload_bound_mean_act_s": t["overload_bound_mean_act_s"],
            "memory_bound_mean_act_s": t.get("memory_bound_mean_act_s"),
            "memory_bound_step_time_s": t.get("memory_bound_step_time_s"),
            "restore_share_of_exec": {p: r.get("restore_share_of_exec") for p, r in res.items()}}


def sweep_markdown(sweep: dict) -> str:
    """One table per workload: tangram and the best baseline per measure, the bounds, the losses."""
    lines = ["| workload | batch | tangram mean / p99 / step (s) | best baseline mean / p99 / step (s) "
             "| pooled bound | memory bound mean / step | no-queue bound | restore share | tangram loses on |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, w in sweep["workloads"].items():
        for row in w["rows"]:
            res, t = row["results"], row["results"]["tangram"]
            best = []
            for m in MEASURES:
                p, r = min(((p, r) for p, r in res.items() if not p.startswith("tangram")), key=lambda pr: pr[1][m])
                best.append(f"{r[m]:.1f} ({p})")
            lost = ", ".join(f"{x['measure'][:-2]} vs {x['policy']} ({x['ratio']}x"
                             + (f", it failed {x['baseline_failed']:,} calls" if x.get("baseline_failed") else "") + ")"
                             for x in row["losses"]) or "nothing"
            share = t.get("restore_share_of_exec") or 0.0
            mem = (f"{row['memory_bound_mean_act_s']:.2f} / {row['memory_bound_step_time_s']:.0f}"
                   if row.get("memory_bound_mean_act_s") is not None else "-")
            lines.append(f"| {name} | {row['batch']} | {t['mean_act_s']:.1f} / {t['p99_act_s']:.1f} / "
                         f"{t['step_time_s']:.0f} | {' / '.join(best)} | {row['overload_bound_mean_act_s']:.2f} "
                         f"| {mem} | {row['lower_bound_mean_act_s']:.2f} | {share:.0%} | {lost} |")
    return "\n".join(lines) + "\n"


def _plot_sweep(sweep: dict, out: Path, plt) -> list[str]:
    files = []
    titles = {"mean_act_s": "mean ACT (s)", "p99_act_s": "p99 ACT (s)", "step_time_s": "step time (s)"}
    for name, w in sweep["workloads"].items():
        rows = w["rows"]
        x = [r["batch"] for r in rows]
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for ax, m in zip(axes, MEASURES):
            for i, p in enumerate(w["policies"]):
                style = "s-" if p == "tangram" else "o--"
                ax.plot(x, [r["results"][p][m] for r in rows], style, color=f"C{i}", label=p)
            if m == "mean_act_s":
                ax.plot(x, [r["lower_bound_mean_act_s"] for r in rows], "k:", label="no-queueing bound")
                ax.plot(x, [r["overload_bound_mean_act_s"] for r in rows], "k-.", label="pooled SRPT bound")
                # only where trajectories wait for memory somewhere (elsewhere it is the no-queueing bound)
                if any((r.get("memory_bound_mean_act_s") or 0) > r["lower_bound_mean_act_s"] * (1 + 1e-9) for r in rows):
                    ax.plot(x, [r.get("memory_bound_mean_act_s") for r in rows], "k--", label="memory-slot bound")
            if m == "step_time_s" and any((r.get("memory_bound_step_time_s") or 0) > r["results"]["tangram"].get(
                    "lower_bound_step_time_s", 0) * (1 + 1e-9) for r in rows):
                ax.plot(x, [r.get("memory_bound_step_time_s") for r in rows], "k--", label="memory-slot bound")
            ax.set(xlabel="batch (trajectories)", ylabel=titles[m], xscale="log", yscale="log")
            ax.set_xticks(x, [str(b) for b in x], minor=False)  # the batches run, not log-scale minor ticks
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
        axes[0].legend(fontsize=7)
        fig.suptitle(f"Load sweep: {name}")
        files.append(_save(fig, out / f"load_sweep_{name}.png"))
    return files


# --------------------------------------------------------------------------- #
# plots


def plot(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    if "cpu_scaling" in results:
        rows = results["cpu_scaling"]["rows"]
        x = [r["batch"] for r in rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(x, [r["trajectory"]["mean_act_s"] for r in rows], "o-", label="trajectory (k8s pods)")
        ax.plot(x, [r["tangram"]["mean_act_s"] for r in rows], "s-", label="tangram")
        ax.plot(x, [r["lower_bound_mean_act_s"] for r in rows], "k:", label="lower bound")
        for r in rows:
            ax.annotate(f"{r['act_ratio']}x", (r["batch"], r["trajectory"]["mean_act_s"]), fontsize=8)
        ax.set(xlabel="batch (trajectories)", ylabel="mean ACT (s)", yscale="log", title="CPU scaling: ai-coding")
        ax.legend()
        files.append(_save(fig, out / "cpu_scaling.png"))
    if "ablation" in results:
        a = results["ablation"]
        names = list(a["results"])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(names, [a["results"][n]["mean_act_s"] for n in names], color=["C1", "C0", "C0", "C0"])
        ax.axhline(a["lower_bound_mean_act_s"], color="k", ls=":", label="lower bound")
        ax.set(ylabel="mean ACT (s)", title=f"Scheduling ablation: ai-coding, batch {a['batch']}")
        ax.legend()
        files.append(_save(fig, out / "ablation.png"))
    if "gpu_scaling" in results:
        g = results["gpu_scaling"]
        rows = g["rows"]
        x = [r["batch"] for r in rows]
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for p, m in (("static-services", "o-"), ("serverless", "^-"), ("tangram", "s-")):
            ax.plot(x, [r[p]["mean_act_s"] for r in rows], m, label=p)
        ax.plot(x, [r["lower_bound_mean_act_s"] for r in rows], "k:", label="lower bound")
        ax.set(xlabel="batch (trajectories)", ylabel="mean ACT (s)", yscale="log", title="GPU scaling: mopd")
        ax.legend()
        for i, gc in enumerate(g["gpu_count"]):
            sw = [s for s in gc["sweep"] if "mean_act_s" in s]
            ax2.plot([s["gpus"] for s in sw], [s["mean_act_s"] for s in sw], "s-", color=f"C{i}",
                     label=f"tangram, batch {gc['batch']}")
            ax2.axhline(gc["static_services_mean_act_s"], color=f"C{i}", ls="--",
                        label=f"static-services, {gc['static_services_gpus']} GPUs, batch {gc['batch']}")
        ax2.set(xlabel="GPUs", ylabel="mean ACT (s)", yscale="log", title="GPUs tangram needs to match static-services")
        ax2.legend(fontsize=7)
        files.append(_save(fig, out / "gpu_scaling.png"))
    if "breakdown" in results:
        b = results["breakdown"]
        kinds = ["env", "reward"]
        fig, ax = plt.subplots(figsize=(6, 4))
        w = 0.35
        for i, p in enumerate(("trajectory", "tangram")):
            vals = [b[p][k]["total_act_s_per_trajectory"] for k in kinds] + [b[p]["total_act_s_per_trajectory"]]
            ax.bar([j + i * w for j in range(3)], vals, w, label=p)
        ax.set_xticks([j + w / 2 for j in range(3)], ["environment", "reward", "total"])
        ax.set(ylabel="action time per trajectory (s)", title=f"ai-coding breakdown, batch {b['batch']}")
        ax.legend()
        files.append(_save(fig, out / "breakdown.png"))
    if "end_to_end" in results:
        e = results["end_to_end"]["workloads"]
        fig, ax = plt.subplots(figsize=(8, 4))
        names = list(e)
        pols = sorted({p for w in e.values() for p in w["results"]}, key=lambda p: (p != "tangram", p))
        w = 0.8 / len(pols)
        for i, p in enumerate(pols):
            ax.bar([j + i * w for j in range(len(names))],
                   [e[n]["results"][p]["step_time_s"] if p in e[n]["results"] else 0 for n in names], w, label=p)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(names))], names)
        ax.set(ylabel="step time (s)", title="End to end: rollout step time")
        ax.legend(fontsize=8)
        files.append(_save(fig, out / "end_to_end.png"))
    if "load_sweep" in results:
        files += _plot_sweep(results["load_sweep"], out, plt)
    return files


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


# --------------------------------------------------------------------------- #

FULL = {
    "cpu_batches": [256, 512, 1024, 1536, 2048],
    "ablation_batch": 1280,
    "gpu_batches": [256, 512, 1024, 2048],
    "gpu_count_batches": [256, 2048],
    "gpu_shapes": [(1, 4), (1, 8), (2, 8), (3, 8), (4, 8), (5, 8)],
    "breakdown_batch": 1024,
    "e2e_batch": 1024,
    "sweep_batches": [256, 512, 1024, 2048, 4096],
    "sweep_workloads": None,  # every built-in workload
}
QUICK = {
    "cpu_batches": [256, 1024, 2048],
    "ablation_batch": 1280,
    "gpu_batches": [256, 1024, 2048],
    "gpu_count_batches": [256, 1024],
    "gpu_shapes": [(1, 4), (1, 8), (2, 8), (3, 8), (4, 8), (5, 8)],
    "breakdown_batch": 1024,
    "e2e_batch": 256,
    "sweep_batches": [256, 1024, 2048],
    "sweep_workloads": None,
}
SMOKE = {  # seconds: checks the script end to end, the numbers mean little
    "cpu_batches": [16, 32],
    "ablation_batch": 32,
    "gpu_batches": [16, 32],
    "gpu_count_batches": [16, 32],
    "gpu_shapes": [(1, 4), (1, 8), (5, 8)],
    "breakdown_batch": 32,
    "e2e_batch": 16,
    "sweep_batches": [16, 32],
    "sweep_workloads": ["ai-coding", "mopd"],
}
EXPERIMENTS = {"cpu_scaling": cpu_scaling, "ablation": ablation, "gpu_scaling": gpu_scaling,
               "breakdown": breakdown, "end_to_end": end_to_end, "load_sweep": load_sweep}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer points (a few minutes); default: the full sweep")
    p.add_argument("--smoke", action="store_true", help="tiny batches: checks the script runs (seconds)")
    p.add_argument("--out", default="replicate-out", help="output directory (JSON + PNG)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", choices=sorted(EXPERIMENTS), help="run only these experiments")
    p.add_argument("--sweep-workloads", nargs="*", help="load_sweep: only these workloads (default: every built-in)")
    p.add_argument("--sweep-batches", nargs="*", type=int, help="load_sweep: these batch sizes instead")
    p.add_argument("--merge", action="store_true",
                   help="update --out's results.json: replace the experiments run (load_sweep: the workloads run), "
                        "keep the rest, redraw every plot")
    args = p.parse_args(argv)
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.sweep_workloads:
        cfg = {**cfg, "sweep_workloads": args.sweep_workloads}
    if args.sweep_batches:
        cfg = {**cfg, "sweep_batches": args.sweep_batches}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"mode": "smoke" if args.smoke else "quick" if args.quick else "full", "seed": args.seed, "config": cfg}
    previous = json.loads((out / "results.json").read_text()) if args.merge and (out / "results.json").exists() else {}
    t0 = time.perf_counter()
    for name, fn in EXPERIMENTS.items():
        if args.only and name not in args.only:
            continue
        log(f"[{name}]")
        results[name] = fn(cfg, args.seed)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.merge:
        results = merge_results(out / "results.json", results, previous)
    results["plots"] = plot(results, out)
    if "load_sweep" in results:
        (out / "load_sweep.md").write_text(sweep_markdown(results["load_sweep"]))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(headline(results)))
    return 0


def merge_results(path: Path, new: dict, old: dict) -> dict:
    """``old`` with the experiments of ``new`` in place of its own; a load sweep merges per workload.

    Each merged experiment keeps the mode, seed and config it was run with
    (``runs``), so a file assembled from several runs says which is which.
    """
    merged = dict(old)
    runs = list(old.get("runs", []))
    for name in EXPERIMENTS:
        if name not in new:
            continue
        if name == "load_sweep" and "load_sweep" in old:
            sweep = dict(old["load_sweep"])
            sweep["workloads"] = {**old["load_sweep"]["workloads"], **new["load_sweep"]["workloads"]}
            merged[name] = sweep
        else:
            merged[name] = new[name]
        what = sorted(new["load_sweep"]["workloads"]) if name == "load_sweep" else None
        runs.append({"experiment": name, "mode": new["mode"], "seed": new["seed"], "config": new["config"],
                     **({"workloads": what} if what else {})})
    merged["runs"] = runs
    for k in ("mode", "seed", "config"):
        merged.setdefault(k, new[k])
    merged["wall_s"] = new.get("wall_s")
    return merged


def headline(r: dict) -> dict:
    h: dict = {"mode": r["mode"]}
    if "cpu_scaling" in r:
        h["cpu_scaling_act_ratio"] = {row["batch"]: row["act_ratio"] for row in r["cpu_scaling"]["rows"]}
    if "ablation" in r:
        h["ablation_act_ratio"] = r["ablation"]["act_ratio_vs_tangram"]
    if "gpu_scaling" in r:
        g = r["gpu_scaling"]
        h["gpu_act_ratio_static"] = {row["batch"]: row["act_ratio_static"] for row in g["rows"]}
        h["gpu_act_ratio_serverless"] = {row["batch"]: row["act_ratio_serverless"] for row in g["rows"]}
        h["gpu_fraction_to_match_static"] = {gc["batch"]: gc["fraction_of_gpus"] for gc in g["gpu_count"]}
    if "breakdown" in r:
        h["breakdown_ratio"] = r["breakdown"]["ratio"]
    if "end_to_end" in r:
        h["step_ratio"] = {n: w["step_ratio"] for n, w in r["end_to_end"]["workloads"].items()}
    if "load_sweep" in r:
        h["load_sweep_losses"] = {n: sum(len(row["losses"]) for row in w["rows"]) for n, w in r["load_sweep"]["workloads"].items()}
    h["wall_s"] = r.get("wall_s")
    return h


if __name__ == "__main__":
    sys.exit(main())
