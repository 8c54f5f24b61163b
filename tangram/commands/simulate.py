"""``tangram simulate``: run rollout steps of a workload on the simulated cluster."""
from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate rollout steps of a workload under a policy (or all of them)",
        description="Drive the real engine and policy on a virtual clock with simulated executors.",
    )
    p.add_argument("--workload", required=True,
                   help="built-in name (ai-coding, cpu-contended, deepsearch, mopd, mopd-skewed, mopd+search) or a YAML file")
    p.add_argument("--policy", default="tangram",
                   help="tangram, tangram:fcfs|aging (queue order), trajectory, fixed-dop:N, static-services, "
                        "serverless, serverless:fewest, api-naive, api-retry, or all")
    p.add_argument("--cluster", help="YAML file with cpu_nodes/cores_per_node/gpu_nodes/gpus_per_node/api (replaces the workload's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replica", type=_replica, default=0,
                   help="0: the seed's own run; R > 0: the same work with every generation gap moved by "
                        "under 5 ms either way (a stream per R), to see how far one run's result moves")
    p.add_argument("--batch", type=int, help="trajectories per step (per job), overriding the workload")
    p.add_argument("--steps", type=int, help="rollout steps, overriding the workload")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--warm-start", dest="warm_start", action="store_true", default=True,
                      help="GPU nodes load their models before the first request (gpu_nodes[].warm_start), under "
                           "every policy that runs tangram's GPU manager (all but static-services and serverless): "
                           "the default")
    warm.add_argument("--cold-start", dest="warm_start", action="store_false",
                      help="GPU nodes load each model when a request first needs it (gpu_nodes[].warm_start: false)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line (a list under 'results' with --policy all)")
    p.add_argument("--check", action="store_true", help="check the managers' invariants after every event (slow)")
    p.set_defaults(func=_run)


def _replica(text: str) -> int:
    try:
        r = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if r < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {r}")
    return r


def _run(args) -> int:
    from tangram.core.errors import TangramError
    from tangram.simulator.policies import policy_spec, warm_started
    from tangram.simulator.sim import simulate
    from tangram.simulator.workload import load_cluster, load_workload

    try:
        wl = load_workload(args.workload)
        if args.cluster:
            wl = wl.with_cluster(load_cluster(args.cluster))
        if args.batch is not None:
            wl = wl.with_batch(args.batch)
        if args.steps is not None:
            wl = wl.with_steps(args.steps)
        if args.policy == "all":
            names = ["tangram"] + [n for n in wl.baselines.compare if n != "tangram"]
        else:
            names = [args.policy]
        specs = [policy_spec(n) for n in names]  # unknown names fail before any simulation runs
        specs = [warm_started(s, args.warm_start) for s in specs]
        results = [simulate(wl, s, seed=args.seed, check=args.check, replica=args.replica).summary for s in specs]
    except TangramError as exc:
        print(f"tangram simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = results[0] if len(results) == 1 else {"workload": wl.name, "results": results, **_head(results[0])}
        print(json.dumps(out, separators=(",", ":")))
    else:
        _table(results)
    return 0


def _head(first: dict) -> dict:
    keys = ("policy", "actions", "mean_act_s", "p50_act_s", "p99_act_s", "mean_queue_s", "mean_exec_s",
            "step_time_s", "lower_bound_mean_act_s", "overload_bound_mean_act_s")
    return {k: first[k] for k in keys}


def _table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    first = results[0]
    t = Table(title=f"{first['workload']}: {first['trajectories']} trajectories x {first['steps']} step(s), "
                    f"{first['actions']} actions (lower bound: mean ACT {first['lower_bound_mean_act_s']:.2f} s, "
                    f"step {first['lower_bound_step_time_s']:.0f} s)")
    cols = ["policy", "mean ACT s", "p50", "p99", "queue s", "exec s", "restore s", "step time s",
            "failed", "retries", "util / reserved"]
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right")
    base = first["mean_act_s"]
    for r in results:
        util = "  ".join(f"{k} {v['utilisation']:.0%}/{v['reserved_frac']:.0%}" if v["utilisation"] is not None
                         else f"{k} -/{v['reserved_frac']:.0%}" for k, v in r["pools"].items())
        ratio = "" if r is first or not base else f" ({r['mean_act_s'] / base:.1f}x)"
        t.add_row(r["policy"], f"{r['mean_act_s']:.2f}{ratio}", f"{r['p50_act_s']:.2f}", f"{r['p99_act_s']:.2f}",
                  f"{r['mean_queue_s']:.2f}", f"{r['mean_exec_s']:.2f}", f"{r['mean_restore_s']:.2f}",
                  f"{r['step_time_s']:.0f}", str(r["failed"]), str(r["retries"]), util)
    Console(width=max(Console().width, 170)).print(t)
