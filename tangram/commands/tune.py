"""``tangram tune``: pick depth, look-ahead and per-class DoP caps on the simulator.

    tangram tune --workload ai-coding --profiles profiles.json --map test-suite=algo-suite \\
                 --batch 64 --cpu-nodes 1 --cores-per-node 32 --trials 40 --seeds 0,1 --out tuned.json

Prints the chosen values and their simulated mean ACT next to the defaults';
``--out`` writes them as JSON (``policy: {depth, lookahead, dop_caps}``);
``--config-out`` writes them as the ``scheduler:`` section of a cluster config,
which ``tangram serve --config cluster.yaml --config tuned.yaml`` merges in.
"""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("tune", help="tune the scheduler's depth, look-ahead and DoP caps on the simulator (optuna)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, help="a built-in workload name (tangram/workloads) or a YAML path")
    p.add_argument("--profiles", help="a profile store (tangram profile --out) whose classes replace the workload's")
    p.add_argument("--map", action="append", default=[], metavar="WL_CLASS=PROFILE_CLASS",
                   help="use this profile class for that workload class (repeatable)")
    p.add_argument("--keep-durations", action="store_true",
                   help="take only E(m) from the profiles, keep the workload's duration distributions")
    p.add_argument("--batch", type=int, help="trajectories per step (smaller is faster to simulate)")
    p.add_argument("--steps", type=int, help="rollout steps to simulate")
    p.add_argument("--cpu-nodes", type=int, help="override the cluster's CPU node count")
    p.add_argument("--cores-per-node", type=int, help="override the cluster's cores per CPU node")
    p.add_argument("--seeds", default="0", help="simulation seeds, comma-separated (default 0)")
    p.add_argument("--trials", type=int, default=30, help="optuna trials (default 30)")
    p.add_argument("--timeout", type=float, help="stop searching after this many seconds")
    p.add_argument("--sampler-seed", type=int, default=0, help="seed of the optuna sampler (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and scripts)")
    p.add_argument("--out", help="write the chosen values (JSON)")
    p.add_argument("--config-out", help="write the chosen values as a config fragment (YAML, `scheduler:` section) "
                                        "for `tangram serve --config CLUSTER --config FRAGMENT`")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import json
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from profiling.tune import apply_profiles, params_dict, tune
    from tangram.simulator.errors import WorkloadError
    from tangram.simulator.workload import load_workload

    err = Console(stderr=True)
    out = Console()
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        if not seeds:
            raise ValueError("--seeds: at least one seed")
        if args.trials < 1:
            raise ValueError("--trials: must be >= 1")
        mapping = {}
        for m in args.map:
            k, sep, v = m.partition("=")
            if not sep or not k or not v:
                raise ValueError(f"--map: expected WL_CLASS=PROFILE_CLASS, got {m!r}")
            mapping[k] = v
        wl = load_workload(args.workload)
        if args.batch is not None:
            wl = wl.with_batch(args.batch)
        if args.steps is not None:
            wl = wl.with_steps(args.steps)
        if args.cpu_nodes is not None or args.cores_per_node is not None:
            c = wl.cluster
            wl = wl.with_cluster(replace(c, cpu_nodes=args.cpu_nodes if args.cpu_nodes is not None else c.cpu_nodes,
                                         cores_per_node=args.cores_per_node or c.cores_per_node))
        applied = {}
        if args.profiles:
            from profiling.store import ProfileStore

            wl, applied = apply_profiles(wl, ProfileStore.load(args.profiles), mapping=mapping,
                                         keep_durations=args.keep_durations)
        elif mapping:
            raise ValueError("--map needs --profiles")
    except (ValueError, KeyError, OSError, WorkloadError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        err.print(f"[bold red]tangram tune[/]: {msg}", highlight=False)
        return 2

    for k, v in applied.items():
        err.print(f"profile {v!r} -> workload class {k!r}", highlight=False)

    def run(on_trial=None):
        return tune(wl, seeds=seeds, n_trials=args.trials, timeout_s=args.timeout, sampler_seed=args.sampler_seed,
                    on_trial=on_trial)

    if args.no_progress:
        res = run()
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err) as bar:
            task = bar.add_task("tuning", total=args.trials)
            res = run(lambda n, act, best: bar.update(task, advance=1,
                                                      description=f"tuning: best mean ACT {best:.3f} s"))

    t = Table(title=f"tangram tune: {wl.name} ({wl.trajectories} trajectories, seeds {seeds}, {res.trials} trials)")
    t.add_column("")
    t.add_column("default")
    t.add_column("tuned")
    t.add_row("depth", str(res.default.depth), str(res.best.depth))
    t.add_row("lookahead", str(res.default.lookahead), str(res.best.lookahead))
    for name in sorted(res.classes):
        t.add_row(f"dop cap: {name}", str(res.default.dop_caps.get(name, "-")),
                  str(res.best.dop_caps.get(name, "-")) + f" (max {res.classes[name]})")
    t.add_row("simulated mean ACT (s)", f"{res.default_metrics['mean_act_s']:.3f}",
              f"{res.best_metrics['mean_act_s']:.3f} ({-100 * res.improvement:+.1f} %)")
    t.add_row("simulated step time (s)", f"{res.default_metrics['step_time_s']:.3f}",
              f"{res.best_metrics['step_time_s']:.3f}")
    out.print(t)
    if args.out:
        doc = {**res.to_dict(), "workload": wl.name, "trajectories": wl.trajectories, "seeds": seeds,
               "profiles": args.profiles, "applied_profiles": applied}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        err.print(f"wrote {args.out}", highlight=False)
    if args.config_out:
        import yaml

        with open(args.config_out, "w", encoding="utf-8") as f:
            f.write(f"# tangram tune: workload {wl.name}, seeds {seeds}, {res.trials} trials; simulated mean ACT "
                    f"{res.best_metrics['mean_act_s']:.3f} s (defaults {res.default_metrics['mean_act_s']:.3f} s)\n"
                    "# use: tangram serve --config CLUSTER.yaml --config THIS_FILE\n")
            yaml.safe_dump({"scheduler": params_dict(res.best)}, f, sort_keys=False)
        err.print(f"wrote {args.config_out}", highlight=False)
    print(json.dumps({"chosen": params_dict(res.best), "mean_act_s": res.best_metrics["mean_act_s"],
                      "default_mean_act_s": res.default_metrics["mean_act_s"]}))
    return 0
