"""``tangram demo``: the main job, a real agentic-coding rollout on this machine.

Measures this machine first (parallel speedup, how busy it is), then runs the same
rollout several times, interleaved, under three policies: Tangram (the scheduler
service in-process on this machine's cores, real HTTP, real local executor), Ray
tasks (every action a task with fixed num_cpus) and a pod per trajectory. Prints
medians with their spread and the ratios, projects the measured actions to a
cluster on the simulator (labelled simulated), and writes a chart.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("demo", help="run a real agentic-coding rollout: tangram vs trajectory-level allocation",
                       description=__doc__)
    p.add_argument("--trajectories", type=int, default=3, help="trajectories in the rollout step (default 3)")
    p.add_argument("--turns", type=int, default=3, help="shell actions per trajectory before its reward (default 3)")
    p.add_argument("--gap-s", type=float, default=1.0, help="mean LLM generation time between actions (default 1.0)")
    p.add_argument("--cores", type=int, default=None, help="cores to use (default: all this process may use)")
    p.add_argument("--pod-cores", type=int, default=1, help="cores of one trajectory's pod in the baseline (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the simulated LLM generation times between actions (default 0)")
    p.add_argument("--out", default="tangram-demo", help="where the chart and summary go (default ./tangram-demo)")
    p.add_argument("--profile", default=None, help="profile store for the reward suite (default: the shipped one)")
    p.add_argument("--calibrate", action="store_true",
                   help="first measure the reward suite's elasticity on this machine (tangram profile) and use it")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per policy, interleaved (tangram, Ray tasks, pods, tangram, ...); the table shows "
                        "medians and min..max; a verdict needs at least 2 (default 3)")
    p.add_argument("--skip-baseline", action="store_true", help="run only the tangram rollout")
    p.add_argument("--no-ray", action="store_true", help="leave the Ray tasks baseline out")
    p.add_argument("--project-cores", type=int, default=3840,
                   help="cores of the cluster the measured rollout is projected to on the simulator "
                        "(default 3840: the paper's 15 nodes x 256 cores)")
    p.add_argument("--project-trajectories", type=int, default=2048,
                   help="trajectories per step of that projection (default 2048, the paper's largest batch)")
    p.add_argument("--project-serial-fraction", type=float, default=None,
                   help="Amdahl serial fraction of the reward suite for the projection "
                        "(default: the profile store's, as measured)")
    p.add_argument("--no-projection", action="store_true", help="skip the simulated projection")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument("--workload", choices=("coding", "deepsearch", "mopd"), default="coding",
                   help="coding (default): shell actions + a test-suite reward; deepsearch: a quota-limited search "
                        "API; mopd: teacher models sharing devices")
    p.add_argument("--max-searches", type=int, default=8, help="deepsearch: searches per trajectory (default 8)")
    p.add_argument("--api-limits", default="3,6,2",
                   help="deepsearch: the search API's CONCURRENCY,QUOTA,PERIOD_S (default 3,6,2)")
    p.add_argument("--devices", type=int, default=1,
                   help="mopd: devices the teachers share under tangram (default 1; static: one per teacher)")
    p.set_defaults(func=_run)


def _positive(name: str, value, minimum=1):
    if value is not None and value < minimum:
        raise SystemExit(f"tangram demo: --{name} must be >= {minimum}, got {value}")


def _run(args: argparse.Namespace) -> int:
    import asyncio

    if args.workload != "coding":
        from tangram.demo.workload_cli import run_workload

        if args.repeats is None:
            args.repeats = 3  # a verdict needs a spread: ~3 min for each workload at its defaults (README)
        return run_workload(args)

    if args.repeats is None:
        args.repeats = 3
    for name in ("trajectories", "turns", "cores", "pod_cores", "repeats", "project_cores",
                 "project_trajectories"):
        _positive(name.replace("_", "-"), getattr(args, name))
    _positive("gap-s", args.gap_s, 0)
    f = args.project_serial_fraction
    if f is not None and not 0.0 <= f <= 1.0:
        raise SystemExit(f"tangram demo: --project-serial-fraction must be within [0, 1], got {f}")
    available = len(os.sched_getaffinity(0))
    if args.cores is not None and args.cores > available:
        raise SystemExit(f"tangram demo: --cores {args.cores}: this process may use only {available} cores")
    if args.cores is not None and args.pod_cores > args.cores or args.pod_cores > available:
        raise SystemExit(f"tangram demo: --pod-cores {args.pod_cores} is more than the "
                         f"{args.cores or available} cores the demo uses")
    if args.calibrate:
        args.profile = _calibrate(args)
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 130


def _calibrate(args: argparse.Namespace) -> str:
    """Profile the demo's suite at DoP 1, 2, 4, ... on the cores the demo will use."""
    from tangram.cli import main as cli_main
    from tangram.demo.rollout import PROJECT_DIR, REWARD_PROFILE, reward_command

    cores = len(os.sched_getaffinity(0)) if args.cores is None else args.cores
    dops = [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= cores] or [1]
    out = Path(args.out) / "numkit_profile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = cli_main(["profile", "--name", REWARD_PROFILE, "--command", reward_command(), "--workdir", str(PROJECT_DIR),
                   "--dop", ",".join(map(str, dops)), "--repeats", "2", "--out", str(out)])
    if rc != 0:
        raise SystemExit(f"tangram demo: calibrating the reward suite failed (exit {rc})")
    return str(out)


async def _main(args: argparse.Namespace) -> int:
    import tempfile

    from rich.console import Console

    from tangram.demo.machine import explain, measure
    from tangram.demo.ray_tasks import INSTALL_HINT, RayTasks, ray_available
    from tangram.demo.report import print_projection, print_table, summarize, write_chart
    from tangram.demo.results import document, policy_entry
    from tangram.demo.rollout import RolloutSpec

    console = Console(stderr=True)
    available = sorted(os.sched_getaffinity(0))
    cores = available[: args.cores] if args.cores else available
    spec = RolloutSpec(trajectories=args.trajectories, turns=args.turns, gap_s=args.gap_s, seed=args.seed,
                       cores=len(cores), pod_cores=min(args.pod_cores, len(cores)))
    profile = args.profile or str(Path(__file__).resolve().parents[1] / "demo" / "numkit_profile.json")
    out = Path(args.out)
    console.print(f"[bold]ARL-Tangram demo[/]: {spec.trajectories} trajectories x ({spec.turns} shell actions + "
                  f"1 test-suite reward) on {len(cores)} cores {cores}, {args.repeats} interleaved runs per policy")
    isolation = _isolation(console)
    machine = measure(cores)
    for line in explain(machine):
        console.print(f"[dim]machine:[/] {line}")
    order = ["tangram"]
    ray = None
    if not args.skip_baseline:
        if args.no_ray:
            pass
        elif ray_available():
            console.print(f"starting a local Ray instance ({len(cores)} CPUs) for the Ray tasks baseline ...")
            ray = RayTasks(len(cores), reward_dop=spec.pod_cores)
            order.append("ray-tasks")
        else:
            console.print(INSTALL_HINT, markup=False)  # "[ray]" is not rich markup
        order.append("trajectory")
    runs: dict[str, list] = {name: [] for name in order}
    try:
        with tempfile.TemporaryDirectory(prefix="tangram-demo-") as tmp:
            for k in range(args.repeats):  # interleaved: A B C A B C ..., so a load change hits every policy
                for name in order:
                    where = Path(tmp) / f"{name}-{k}"
                    label = f"{name:<10} run {k + 1}/{args.repeats}"
                    if name == "tangram":
                        r = await _tangram_phase(spec, cores, profile, where, console, label, isolation)
                    elif name == "ray-tasks":
                        prog, tick = _progress(console, label, spec.trajectories * (spec.turns + 1))
                        with prog:
                            r = await ray.run(spec, where, tick)
                    else:
                        r = await _static_phase(spec, cores, where, console, label, isolation)
                    runs[name].append(r)
    finally:
        if ray is not None:
            ray.close()
    policies = {name: policy_entry([summarize(r, len(cores)) for r in rs]) for name, rs in runs.items()}
    projection = None
    if not args.skip_baseline and not args.no_projection:
        from tangram.demo.projection import inputs, project
        from tangram.demo.rollout import REWARD_PROFILE

        console.print(f"projecting to {args.project_trajectories} trajectories on {args.project_cores} cores "
                      "(simulator) ...")
        inp = inputs(spec, runs, profile, REWARD_PROFILE, args.project_serial_fraction)
        projection = project(inp, cores=args.project_cores, trajectories=args.project_trajectories,
                             pod_cores=spec.pod_cores, ray_dop=spec.pod_cores if ray is not None else None,
                             seed=args.seed, scaling_scenario=args.project_serial_fraction is None)
    doc = document("coding", policies, reference="tangram", projection=projection, machine=machine,
                   spec={k: getattr(spec, k) for k in spec.__dataclass_fields__}, repeats=args.repeats)
    wide = Console(width=max(140, Console().width))
    print_table(wide, policies, doc["ratios"])
    if projection:
        print_projection(wide, projection)
    doc["chart"] = str(write_chart(out / "demo.png", policies, doc["ratios"], projection))
    (out / "summary.json").write_text(json.dumps(doc, indent=2))
    console.print(f"chart: {doc['chart']}   summary: {out / 'summary.json'}")
    if args.json:
        print(json.dumps(doc))
    failed = {name: p["failed"] for name, p in policies.items() if p["failed"]}
    for name, n in failed.items():
        console.print(f"[red]{name}: {n} actions failed (over {args.repeats} runs; their ACTs are in its means)[/]")
    return 1 if failed else 0


def _progress(console, label: str, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)
    task = prog.add_task(label, total=total)
    return prog, (lambda: prog.advance(task))


def _isolation(console) -> str:
    """The demo's commands are the project's own, trusted: sandboxed when this machine can, else not (said)."""
    from tangram.executors.sandbox import probe

    ok, why = probe()
    if ok:
        return "sandbox"
    console.print(f"[yellow]this machine cannot sandbox commands ({why}): the demo runs its own trusted commands "
                  "with isolation none; tangram serve would refuse to start in this state[/]")
    return "none"


async def _tangram_phase(spec, cores, profile: str, workdir: Path, console, label: str, isolation: str):
    from aiohttp import web

    from tangram.client import TangramClient
    from tangram.demo.rollout import PROJECT_DIR, run_with_service
    from tangram.service.app import create_app
    from tangram.service.config import parse_config

    cfg = parse_config({
        "service": {"host": "127.0.0.1", "port": 0},
        "cpu_nodes": [{"name": "local", "executor": "local", "cores": list(cores), "workdir": str(workdir),
                       "isolation": isolation, "readonly": [str(PROJECT_DIR)]}],
        "gpu_nodes": [],
        "profiles": [profile],
    })
    runner = web.AppRunner(create_app(cfg))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    prog, tick = _progress(console, label, spec.trajectories * (spec.turns + 1))
    try:
        async with TangramClient(f"http://127.0.0.1:{port}") as client:
            with prog:
                return await run_with_service(client, spec, tick)
    finally:
        await runner.cleanup()


async def _static_phase(spec, cores, workdir: Path, console, label: str, isolation: str):
    from tangram.demo.rollout import PROJECT_DIR, run_static
    from tangram.executors.local import LocalExecutor

    executor = LocalExecutor(str(workdir), sandbox=isolation, readonly=(str(PROJECT_DIR),))
    prog, tick = _progress(console, label, spec.trajectories * (spec.turns + 1))
    try:
        with prog:
            return await run_static(executor, spec, list(cores), tick)
    finally:
        await executor.close()
