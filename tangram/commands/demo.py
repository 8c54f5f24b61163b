"""``tangram demo``: the main job, a real agentic-coding rollout on this machine.

Starts the scheduler service in-process on the embedded default (local
executor, this machine's cores), runs the rollout against it over real HTTP,
runs the same rollout under trajectory-level static allocation, and prints
the comparison (and a chart).
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
    p.add_argument("--trajectories", type=int, default=6, help="trajectories in the rollout step (default 6)")
    p.add_argument("--turns", type=int, default=4, help="shell actions per trajectory before its reward (default 4)")
    p.add_argument("--gap-s", type=float, default=1.0, help="mean LLM generation time between actions (default 1.0)")
    p.add_argument("--cores", type=int, default=None, help="cores to use (default: all this process may use)")
    p.add_argument("--pod-cores", type=int, default=1, help="cores of one trajectory's pod in the baseline (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the simulated LLM generation times between actions (default 0)")
    p.add_argument("--out", default="tangram-demo", help="where the chart and summary go (default ./tangram-demo)")
    p.add_argument("--profile", default=None, help="profile store for the reward suite (default: the shipped one)")
    p.add_argument("--calibrate", action="store_true",
                   help="first measure the reward suite's elasticity on this machine (tangram profile) and use it")
    p.add_argument("--skip-baseline", action="store_true", help="run only the tangram rollout")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument("--workload", choices=("coding", "deepsearch", "mopd"), default="coding",
                   help="coding (default): shell actions + a test-suite reward; deepsearch: a quota-limited search "
                        "API; mopd: teacher models sharing devices")
    p.add_argument("--repeats", type=int, default=1, help="deepsearch/mopd: runs of each policy (default 1)")
    p.add_argument("--max-searches", type=int, default=8, help="deepsearch: searches per trajectory (default 8)")
    p.add_argument("--api-limits", default="3,6,2",
                   help="deepsearch: the search API's CONCURRENCY,QUOTA,PERIOD_S (default 3,6,2)")
    p.set_defaults(func=_run)


def _positive(name: str, value, minimum=1):
    if value is not None and value < minimum:
        raise SystemExit(f"tangram demo: --{name} must be >= {minimum}, got {value}")


def _run(args: argparse.Namespace) -> int:
    import asyncio

    if args.workload != "coding":
        from tangram.demo.workload_cli import run_workload

        return run_workload(args)

    for name in ("trajectories", "turns", "cores", "pod_cores"):
        _positive(name.replace("_", "-"), getattr(args, name))
    _positive("gap-s", args.gap_s, 0)
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

    from tangram.demo.report import print_table, ratios, summarize, write_chart
    from tangram.demo.rollout import RolloutSpec

    console = Console(stderr=True)
    available = sorted(os.sched_getaffinity(0))
    cores = available[: args.cores] if args.cores else available
    spec = RolloutSpec(trajectories=args.trajectories, turns=args.turns, gap_s=args.gap_s, seed=args.seed,
                       cores=len(cores), pod_cores=min(args.pod_cores, len(cores)))
    profile = args.profile or str(Path(__file__).resolve().parents[1] / "demo" / "numkit_profile.json")
    out = Path(args.out)
    console.print(f"[bold]ARL-Tangram demo[/]: {spec.trajectories} trajectories x ({spec.turns} shell actions + "
                  f"1 test-suite reward) on {len(cores)} cores {cores}")
    isolation = _isolation(console)
    summaries: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tangram-demo-") as tmp:
        r = await _tangram_phase(spec, cores, profile, Path(tmp) / "tangram", console, isolation)
        summaries["tangram"] = summarize(r, len(cores))
        if not args.skip_baseline:
            r = await _static_phase(spec, cores, Path(tmp) / "static", console, isolation)
            summaries["trajectory"] = summarize(r, len(cores))
    rat = ratios(summaries["tangram"], summaries["trajectory"]) if "trajectory" in summaries else None
    print_table(Console(width=max(120, Console().width)), summaries, rat)
    chart = write_chart(out / "demo.png", summaries)
    doc = {"machine": {"cores": len(cores), "cpu_count": os.cpu_count()},
           "spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
           **summaries, "ratios": rat, "chart": str(chart)}
    (out / "summary.json").write_text(json.dumps(doc, indent=2))
    console.print(f"chart: {chart}   summary: {out / 'summary.json'}")
    if args.json:
        print(json.dumps(doc))
    failed = sum(s["failed"] for s in summaries.values())
    if failed:
        console.print(f"[red]{failed} actions failed[/]")
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


async def _tangram_phase(spec, cores, profile: str, workdir: Path, console, isolation: str):
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
    prog, tick = _progress(console, "tangram    ", spec.trajectories * (spec.turns + 1))
    try:
        async with TangramClient(f"http://127.0.0.1:{port}") as client:
            with prog:
                return await run_with_service(client, spec, tick)
    finally:
        await runner.cleanup()


async def _static_phase(spec, cores, workdir: Path, console, isolation: str):
    from tangram.demo.rollout import PROJECT_DIR, run_static
    from tangram.executors.local import LocalExecutor

    executor = LocalExecutor(str(workdir), sandbox=isolation, readonly=(str(PROJECT_DIR),))
    prog, tick = _progress(console, "trajectory ", spec.trajectories * (spec.turns + 1))
    try:
        with prog:
            return await run_static(executor, spec, list(cores), tick)
    finally:
        await executor.close()
