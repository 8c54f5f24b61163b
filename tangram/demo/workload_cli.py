"""``tangram demo --workload deepsearch|mopd``: run, print the table, write the summary."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
from pathlib import Path
from typing import Any


def _fail(msg: str) -> int:
    raise SystemExit(f"tangram demo: {msg}")


def _machine() -> dict[str, Any]:
    return {"cores": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "processor": platform.processor() or None}


def _progress(console, label: str, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    transient=True)
    task = prog.add_task(label, total=total)
    prog.start()

    def tick() -> None:
        prog.advance(task)
        if prog.finished:
            prog.stop()

    return tick


def _cell(s: dict, key: str, fmt: str) -> str:
    if s.get(key) is None:
        return "-"
    lo_hi = (s.get("spread") or {}).get(key)
    return fmt.format(s[key]) + (f" [{fmt.format(lo_hi[0])}..{fmt.format(lo_hi[1])}]" if lo_hi else "")


def _table(console, title: str, doc: dict, extra: list[tuple[str, str, str]], total: str) -> None:
    """Headline columns: median [min..max] over the runs; ``extra`` columns say in their name what they are
    (sum, median, max over runs); ``total``: the policy field counting its actions over all runs."""
    from rich.table import Table

    from tangram.demo.results import one_run_note, verdict

    runs = max(len(s["runs"]) for s in doc["policies"].values())
    t = Table(title=f"{title}: medians of {runs} runs \\[min..max]")
    cols = [("mean ACT (s)", "mean_act_s", "{:.3f}"), ("p50 ACT (s)", "p50_act_s", "{:.3f}"),
            ("p99 ACT (s)", "p99_act_s", "{:.3f}"), ("step time (s)", "step_time_s", "{:.2f}")]
    t.add_column("policy")
    for name, _, _ in [*cols, *extra]:
        t.add_column(name, justify="right")
    t.add_column("failed (sum)", justify="right")
    for policy, s in doc["policies"].items():
        t.add_row(policy, *(_cell(s, k, fmt) for _, k, fmt in cols),
                  *("-" if s.get(k) is None else fmt.format(s[k]) for _, k, fmt in extra),
                  f"{s['failed']} of {s[total]}")
    console.print(t)
    console.print(f"ACT and step time: the median of the {runs} runs \\[min..max]; (sum): summed over the runs, "
                  "(median)/(max): over the runs; a failed action's ACT, often short, is in the means and "
                  "percentiles")
    note = one_run_note(min(len(s["runs"]) for s in doc["policies"].values()))
    if note:
        console.print(f"[yellow]{note}[/]")
    for name, r in (doc.get("ratios") or {}).items():
        console.print(verdict(name, r, doc.get("reference", "tangram")))


def failures(doc: dict) -> tuple[list[str], bool]:
    """A warning per policy that failed actions, and whether any failure is an error: any of the
    reference's, or a baseline's beyond the give-ups it is built to make (``gave_up``: a naive caller
    out of retries on a 429)."""
    ref = doc.get("reference", "tangram")
    lines, error = [], False
    for name, p in doc["policies"].items():
        n = p.get("failed") or 0
        if not n:
            continue
        gave_up = 0 if name == ref else min(n, p.get("gave_up") or 0)
        why = f" ({gave_up} gave up on a 429 after its retries)" if gave_up else ""
        lines.append(f"{name}: {n} actions failed{why}; their ACTs are in its means")
        error = error or n > gave_up
    return lines, error


def run_workload(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.repeats < 1:
        _fail(f"--repeats must be >= 1, got {args.repeats}")
    if args.trajectories < 1:
        _fail(f"--trajectories must be >= 1, got {args.trajectories}")
    if args.gap_s < 0:
        _fail(f"--gap-s must be >= 0, got {args.gap_s}")
    console = Console(stderr=True)
    try:
        if args.workload == "deepsearch":
            doc = asyncio.run(_deepsearch(args, console))
        else:
            doc = asyncio.run(_mopd(args, console))
    except KeyboardInterrupt:
        return 130
    doc["machine"] = _machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.workload}-summary.json"
    path.write_text(json.dumps(doc, indent=2))
    console.print(f"summary: {path}")
    for note in doc.get("notes", ()):
        console.print(f"note: {note}")
    if args.json:
        print(json.dumps(doc))
    lines, error = failures(doc)
    for line in lines:
        console.print(f"[red]{line}[/]")
    return 1 if error else 0


async def _deepsearch(args: argparse.Namespace, console) -> dict:
    from tangram.demo.deepsearch import ApiSpec, DeepSearchSpec, demo
    from tangram.demo.search import MissingDataError

    try:
        conc, quota, period = args.api_limits.split(",")
        api = ApiSpec(concurrency=int(conc), quota=int(quota), period_s=float(period))
    except ValueError:
        _fail(f"--api-limits: expected CONCURRENCY,QUOTA,PERIOD_S (e.g. 3,6,2), got {args.api_limits!r}")
    if api.concurrency < 1 or api.quota < 1 or not api.period_s > 0:
        _fail(f"--api-limits: need concurrency >= 1, quota >= 1, period > 0, got {args.api_limits!r}")
    if args.max_searches < 1:
        _fail(f"--max-searches must be >= 1, got {args.max_searches}")
    spec = DeepSearchSpec(trajectories=args.trajectories, max_searches=args.max_searches, gap_s=args.gap_s,
                          seed=args.seed)
    console.print(f"[bold]ARL-Tangram demo, DeepSearch[/]: {spec.trajectories} FanOutQA questions, up to "
                  f"{spec.max_searches} searches each, on a search API allowing {api.concurrency} concurrent and "
                  f"{api.quota} per {api.period_s:g} s")
    try:
        doc = await demo(spec, api, repeats=args.repeats, baseline=not args.skip_baseline,
                         progress=lambda label, total: _progress(console, label, total))
    except MissingDataError as e:
        _fail(str(e))
    _table(_wide_console(), "DeepSearch rollout (same search API, same questions)", doc,
           [("searches (sum)", "searches", "{}"), ("429s seen (sum)", "caller_429s", "{}"),
            ("retries (sum)", "retries", "{}"), ("gave up on 429 (sum)", "gave_up", "{}")], "searches")
    return doc


async def _mopd(args: argparse.Namespace, console) -> dict:
    from tangram.demo.mopd import MopdSpec, demo

    from tangram.demo.search import MissingDataError

    if args.devices < 1:
        _fail(f"--devices must be >= 1, got {args.devices}")
    spec = MopdSpec(trajectories=args.trajectories, gap_s=args.gap_s, seed=args.seed, devices=args.devices)
    console.print(f"[bold]ARL-Tangram demo, MOPD[/]: {spec.trajectories} trajectories, every one scored by "
                  f"{len(spec.teachers)} teacher models; tangram shares {spec.devices} device(s) by "
                  f"evict-on-execution, static holds one device per teacher")
    try:
        doc = await demo(spec, repeats=args.repeats, baseline=not args.skip_baseline,
                         progress=lambda label, total: _progress(console, label, total))
    except MissingDataError as e:
        _fail(str(e))
    _table(_wide_console(), "MOPD teacher scoring (same trajectories, same models)", doc,
           [("devices", "devices", "{}"), ("restores (sum)", "restores", "{}"),
            ("restore share (median)", "restore_share", "{:.1%}"),
            ("peak device MiB (max)", "peak_device_mb", "{:.0f}")],
           "actions")
    for name, p in doc["policies"].items():
        for k, n in (p.get("runs_without") or {}).items():
            console.print(f"[yellow]{name}: {k} is the median of {len(p['runs']) - n} of {len(p['runs'])} runs "
                          f"({n} had no value: every action of that teacher failed)[/]")
    return doc


def _wide_console():
    from rich.console import Console

    return Console(stderr=True, width=max(120, Console().width))
