#!/usr/bin/env python3
"""Fault suite: a small rollout against a real ``tangram serve`` while faults are injected.

Each of ``--envs`` environments runs ``--steps`` exec actions in order; step
``i`` appends its key to ``runs.txt`` in the environment, then sleeps. A
client resubmits a step with the same ``Idempotency-Key`` after a dropped
connection, and under a new key (a new attempt) after ``failed`` with
``retryable`` or ``cancelled``. Meanwhile, at seeded random points, bounded in
count (``--max-faults``; each kind at least once when the bound allows) and
placed by count of submitted actions (never by the clock, so that a loaded
machine cannot change which faults happen), the suite

* SIGKILLs the service and starts it again on the same state directory,
* cancels individual running actions (``DELETE /v1/actions/<id>``), and
* (``--executor docker``) kills the service's Docker Engine and starts it
  again: the whole engine, as a machine crash would (dockerd, containerd,
  shims and every container process; ``--engine-faults crash``), or
  ``dockerd`` alone (``sigkill``; containerd runs as a service of its own, as
  distribution packages run it, and the containers outlive dockerd until it
  comes back); ``both`` (the default) injects each.

The Docker phase never touches the machine's shared engine: it starts a
private ``dockerd`` and ``containerd`` (own sockets, roots and pid file, see
``tests/private_dockerd.py``), builds the sandbox image in it, points a
Docker-mode service at it and removes it, its directory included, at the end.
``--executor both`` (the default) runs the local phase, then the Docker one.

Checks, printed with ``--json``: every step completed exactly once (its key
appears once in its environment's ``runs.txt``, and every attempt reported
succeeded appears exactly once), no action was lost (each submission got a
final answer: succeeded, failed/retryable or cancelled), every environment
kept its files across restarts, and after the run no process, directory,
cgroup, container, core or memory reservation is left. ``lost`` and
``leaks`` must be 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tangram.service.launch import ServeProcess, ServeStartError, start_serve  # noqa: E402

FINAL = ("succeeded", "failed", "timeout", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, state: Path, cfg: Path, port: int):
        self.state, self.cfg, self.port = state, cfg, port
        self.url = f"http://127.0.0.1:{port}"
        self.serve: ServeProcess | None = None
        self.pids: list[int] = []

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        try:
            self.serve = start_serve(["--config", str(self.cfg), "--port", str(self.port), "--no-auth",
                                      "--log-level", "ERROR"], cwd=REPO, env=env, state_dir=self.state)
        except ServeStartError as exc:
            raise SystemExit(f"chaos: {exc}") from None
        self.pids.append(self.serve.pid)

    def kill(self) -> None:
        self.serve.kill()

    def stop(self) -> None:
        self.serve.stop(grace_s=60)


RETRIES = 60  # attempts at an undo: a restarting engine answers retryable for a few seconds
BACKOFF_S = 0.25  # between them


async def call(session: aiohttp.ClientSession, method: str, url: str, *, patience_s: float = 90.0, **kw):
    """One request, retried while the service is down (connection refused or dropped)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            async with session.request(method, url, **kw) as r:
                return r.status, await r.json(content_type=None)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def rollout(svc: Service, args, plan: FaultPlan, stats: dict, running: dict, quiesce) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        envs = []
        for i in range(args.envs):
            for _ in range(RETRIES):  # the node's engine may be down (502, 503): retried as a client would
                st, body = await call(s, "POST", f"{svc.url}/v1/environments", json={"memory_mb": 128})
                if st not in (502, 503):
                    break
                stats["answers"][f"environment refused {st}, retried"] += 1
                await asyncio.sleep(BACKOFF_S)
            assert st == 201, body
            envs.append(body["id"])
        succeeded: dict[str, list[str]] = {e: [] for e in envs}

        async def run_step(env: str, key: str, cmd: str, number: int = 0) -> dict | None:
            """Submit (resubmitting with the same key while the service is down) and poll to the end;
            ``number``: the step submission's count in the rollout (0: an undo, not counted)."""
            body = {"kind": "exec", "environment": env, "command": cmd, "timeout_s": 60}
            await plan.gate()
            deadline = time.monotonic() + 90
            while True:
                st, r = await call(s, "POST", f"{svc.url}/v1/actions?wait=false", headers={"Idempotency-Key": key},
                                   json=body)
                if st not in (429, 503) or time.monotonic() > deadline:
                    break
                stats["answers"][f"refused {st}, resubmitted"] += 1  # e.g. its node is down: not yet
                await asyncio.sleep(BACKOFF_S)
            if st not in (200, 202):
                stats.setdefault("errors", []).append({"submit": key, "status": st, "body": r})
                return None
            running[key] = r["id"]
            if number:
                plan.submitted(number)
            try:
                while r.get("status") not in FINAL:
                    await asyncio.sleep(0.05)
                    st, r = await call(s, "GET", f"{svc.url}/v1/actions/{running[key]}")
                    if st != 200:  # an acknowledged action the service no longer knows: lost
                        stats.setdefault("errors", []).append({"poll": key, "status": st, "body": r})
                        return None
                return r
            finally:
                running.pop(key, None)

        async def trajectory(env: str) -> None:
            for step in range(args.steps):
                attempt = 0
                while True:
                    key = f"{env}-s{step}-a{attempt}"
                    cmd = f"echo {env}-s{step} >> runs.txt; echo {key} >> attempts.txt; sleep {args.step_s}"
                    stats["submitted"] += 1
                    r = await run_step(env, key, cmd, stats["submitted"])
                    if r is None:
                        stats["lost"] += 1
                        break
                    stats["answers"][r["status"] + ("/retryable" if r.get("retryable") else "")] += 1
                    if r["status"] == "succeeded":
                        succeeded[env].append((f"{env}-s{step}", key))
                        break
                    if r["status"] == "cancelled" or r.get("retryable"):
                        attempt += 1
                        stats["retried"] += 1
                        # the killed attempt may have written its line: undo it, as a client retrying would
                        for u in range(RETRIES):  # the undo itself may be hit by a restart: retried too
                            await asyncio.sleep(BACKOFF_S if r.get("retryable") else 0)  # a node coming back
                            undo = await run_step(env, f"{key}-undo{u}",
                                                  f"grep -vx '{env}-s{step}' runs.txt > t || true; mv t runs.txt")
                            if undo is None or undo["status"] == "succeeded" or not undo.get("retryable"):
                                break
                        if undo is None or undo["status"] != "succeeded":
                            stats["lost"] += 1
                            stats.setdefault("errors", []).append({"undo": key, "result": undo})
                            break
                        continue
                    stats["lost"] += 1  # failed for another reason: not expected in this rollout
                    stats.setdefault("errors", []).append(r)
                    break

        await asyncio.gather(*(trajectory(e) for e in envs))
        await quiesce()  # no fault from here on: the checks below must see the final state
        kept = True
        double = 0
        for env in envs:
            st, r = await call(s, "POST", f"{svc.url}/v1/actions",
                               json={"kind": "exec", "environment": env, "command": "cat runs.txt; echo --; cat attempts.txt"})
            runs, _, attempts = (r.get("stdout") or "").partition("--")
            lines, tried = runs.split(), attempts.split()
            # exactly once: each step's line once, each attempt answered succeeded ran once (no rerun on resubmit)
            double += sum(1 for x in set(lines) if lines.count(x) > 1)
            double += sum(1 for _, key in succeeded[env] if tried.count(key) != 1)
            kept = kept and lines == [step for step, _ in succeeded[env]]
        st, statsdoc = await call(s, "GET", f"{svc.url}/v1/stats")
        busy = {n: p for n, p in statsdoc["pools"].items() if p["type"] != "mem" and p["free"] != p["capacity"]}
        for env in envs:
            await call(s, "DELETE", f"{svc.url}/v1/environments/{env}")
        st, statsdoc = await call(s, "GET", f"{svc.url}/v1/stats")
        mem_held = {n: p for n, p in statsdoc["pools"].items() if p["type"] == "mem" and p["free"] != p["capacity"]}
        return {"files_kept": kept, "double_runs": double, "units_held": busy, "memory_held": mem_held}


class FaultPlan:
    """Which fault comes at which action: by count of submitted steps, not by the clock, so that a loaded
    machine changes when faults land, never whether. Every kind is injected once (in seeded order) before
    any repeats, up to ``max_faults``; each at a seeded submission number of the rollout's first
    ``envs * steps - envs`` submissions, which every run reaches. While a fault is being injected (the
    service or engine coming back), no new action is submitted: the next fault cannot be outrun."""

    def __init__(self, kinds: list[str], args, rng: random.Random):
        order = rng.sample(kinds, len(kinds))
        order += [rng.choice(kinds) for _ in range(max(0, args.max_faults - len(kinds)))]
        order = order[:args.max_faults]
        last = max(1, args.envs * args.steps - args.envs)
        if len(order) > last:
            order = order[:last]
        self.schedule = list(zip(sorted(rng.sample(range(1, last + 1), len(order))), order))
        self.due = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.closed = False  # the injector has stopped: nothing is due any more

    def submitted(self, n: int) -> None:
        """Step submission number ``n`` is running: the next fault is due once its number is reached."""
        if not self.closed and self.schedule and n >= self.schedule[0][0]:
            self.idle.clear()  # no new submission until the fault is in (see gate)
            self.due.set()

    async def gate(self) -> None:
        await self.idle.wait()


async def inject(svc: Service, engine, plan: FaultPlan, args, stats: dict, running: dict,
                 rng: random.Random, stop: asyncio.Event) -> None:
    """One fault at a time when the plan says so, each finished (service or engine back up) before the next."""
    try:
        await _inject(svc, engine, plan, args, stats, running, rng, stop)
    finally:
        plan.closed = True
        plan.idle.set()


async def _inject(svc: Service, engine, plan: FaultPlan, args, stats: dict, running: dict,
                  rng: random.Random, stop: asyncio.Event) -> None:
    t_end = time.monotonic() + args.duration_s  # a bound only: in a run that long something else is wrong
    async with aiohttp.ClientSession() as s:
        while plan.schedule and not stop.is_set() and time.monotonic() < t_end:
            due = asyncio.create_task(plan.due.wait())
            halt = asyncio.create_task(stop.wait())
            await asyncio.wait({due, halt}, return_when=asyncio.FIRST_COMPLETED)
            due.cancel()
            halt.cancel()
            if stop.is_set() or not plan.due.is_set():
                break
            plan.due.clear()
            try:
                await asyncio.sleep(rng.uniform(0.0, 0.5) * args.step_s)  # somewhere in the running action's life
                kind = plan.schedule[0][1]
                if kind == "service_sigkill":
                    svc.kill()
                    await asyncio.sleep(0.2)
                    await asyncio.to_thread(svc.start)
                elif kind.startswith("engine_"):
                    # dockerd alone (containerd and the containers outlive it) or the whole engine (a crash)
                    await asyncio.to_thread(engine.kill_daemon if kind == "engine_sigkill" else engine.kill)
                    await asyncio.sleep(rng.uniform(0.2, 1.0))  # actions meanwhile are answered failed/retryable
                    await asyncio.to_thread(engine.start)
                else:
                    ids = [aid for key, aid in list(running.items()) if "-undo" not in key]
                    if not ids:
                        continue  # the action finished first: this cancel waits for the next submission
                    try:
                        async with s.delete(f"{svc.url}/v1/actions/{rng.choice(ids)}") as r:
                            await r.read()
                    except aiohttp.ClientError:
                        continue
                plan.schedule.pop(0)
                stats["faults"][kind] += 1
            finally:
                plan.idle.set()


def leaks(svc: Service, state: Path) -> dict:
    out: dict = {}
    procs = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if str(state).encode() in open(f"/proc/{d}/cmdline", "rb").read():
                    procs.append(int(d))
            except OSError:
                pass
    out["processes"] = procs
    envs_root = state / "envs"
    out["directories"] = sorted(str(p) for p in envs_root.glob("*/*")) if envs_root.exists() else []
    groups = []
    for parent in ("/sys/fs/cgroup/memory/tangram-limits", "/sys/fs/cgroup/pids/tangram-limits",
                   "/sys/fs/cgroup/cpuset/tangram"):
        if os.path.isdir(parent):
            groups += [g for g in os.listdir(parent) if any(g.startswith(f"p{pid}-") for pid in svc.pids)]
    out["cgroups"] = groups
    return out


def engine_leaks(engine, containers: set[str]) -> dict:
    """With the services stopped: containers, their processes and cgroups left on the private engine."""
    client = engine.client()
    try:
        left = [c.id[:12] for c in client.containers.list(all=True)]
    finally:
        client.close()
    daemons = {engine.proc.pid} if engine.proc else set()
    procs = []
    for pid in engine.processes():
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        if pid not in daemons and name != "containerd":  # shims and container processes: none may be left
            procs.append(f"{pid}:{name}")
    groups = [f"{ctrl}/docker/{cid[:12]}" for cid in containers for ctrl in ("memory", "pids", "cpuset")
              if os.path.exists(f"/sys/fs/cgroup/{ctrl}/docker/{cid}")]
    return {"containers": left, "engine_processes": procs, "container_cgroups": groups}


async def track_containers(engine, seen: set[str], stop: asyncio.Event) -> None:
    """Every container the private engine ever held (its cgroups must be gone at the end)."""
    while not stop.is_set():
        try:
            client = engine.client(timeout=5)
            try:
                seen.update(c.id for c in await asyncio.to_thread(client.containers.list, all=True))
            finally:
                client.close()
        except Exception:  # noqa: BLE001 - the engine is down right now
            pass
        await asyncio.sleep(0.5)


async def phase(executor: str, args, rng: random.Random, tmp: Path) -> dict:
    engine = None
    if executor == "docker":
        from tangram.executors.docker_image import ensure_image
        from tests.private_dockerd import PrivateDockerd

        engine = PrivateDockerd()
        engine.start()
        client = engine.client()
        ensure_image(client)  # the sandbox image, built in the private engine (no registry, no shared engine)
        client.close()
        node = f"{{name: d0, executor: docker, endpoint: '{engine.endpoint}', cores: {args.cores}, memory_mb: 2048}}"
    else:
        node = f"{{name: local, executor: local, cores: {args.cores}, memory_mb: 2048}}"
    services: list[Service] = []
    try:
        cfg = tmp / f"{executor}.yaml"
        cfg.write_text(f"cpu_nodes:\n  - {node}\ngpu_nodes: []\n")
        state = tmp / f"state-{executor}"
        svc = Service(state, cfg, free_port())
        services.append(svc)
        svc.start()
        stats = {"submitted": 0, "retried": 0, "lost": 0, "answers": _Counter(),
                 "faults": _Counter({k: 0 for k in ("service_sigkill", "action_cancel")}
                                    | ({k: 0 for k in ENGINE_FAULTS[args.engine_faults]} if engine else {}))}
        running: dict = {}
        stop = asyncio.Event()
        containers: set[str] = set()
        t0 = time.monotonic()
        kinds = ["service_sigkill", "action_cancel"] + (ENGINE_FAULTS[args.engine_faults] if engine else [])
        plan = FaultPlan(kinds, args, rng)
        injector = asyncio.create_task(inject(svc, engine, plan, args, stats, running, rng, stop))
        tracker = asyncio.create_task(track_containers(engine, containers, stop)) if engine else None

        async def quiesce() -> None:
            stop.set()
            await injector

        try:
            result = await rollout(svc, args, plan, stats, running, quiesce)
        finally:
            stop.set()
            await injector
            if tracker is not None:
                await tracker
        svc.stop()
        leaked = leaks(svc, state)
        if engine is not None:
            leaked.update(engine_leaks(engine, containers))
        n_leaks = sum(len(v) for v in leaked.values()) + len(result["units_held"]) + len(result["memory_held"])
        report = {
            "executor": executor, "duration_s": round(time.monotonic() - t0, 2),
            "faults": dict(stats["faults"]), "faults_injected": sum(stats["faults"].values()),
            "actions_submitted": stats["submitted"], "answers": dict(stats["answers"]),
            "retried": stats["retried"], "actions_lost": stats["lost"], "double_runs": result["double_runs"],
            "files_kept": result["files_kept"], "leaks": n_leaks,
            "leak_detail": {**leaked, "units_held": result["units_held"], "memory_held": result["memory_held"]},
            "errors": stats.get("errors", [])[:5],
        }
        if engine is not None:
            report["containers_seen"] = len(containers)  # whose cgroups were checked
    finally:
        for svc in services:  # interrupted: the service must not outlive the run either
            if svc.serve is not None:
                svc.serve.kill()
        if engine is not None:
            engine.remove()
    if engine is not None:  # removed completely: no process, mount or file of it
        gone = {"engine_left": [engine.dir] if os.path.exists(engine.dir) else [],
                "engine_processes_after_removal": engine.processes()}
        report["leak_detail"].update(gone)
        report["leaks"] += sum(len(v) for v in gone.values())
    return report


async def main_async(args) -> dict:
    rng = random.Random(args.seed)
    executors = ["local", "docker"] if args.executor == "both" else [args.executor]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tangram-chaos-") as tmp:
        phases = [await phase(ex, args, rng, Path(tmp)) for ex in executors]
    faults = _Counter()
    for ph in phases:
        for k, v in ph["faults"].items():
            faults[k] += v
    return {
        "seed": args.seed, "envs": args.envs, "steps": args.steps, "executors": executors,
        "duration_s": round(time.monotonic() - t0, 2), "faults": dict(faults),
        "faults_injected": sum(ph["faults_injected"] for ph in phases),
        "actions_submitted": sum(ph["actions_submitted"] for ph in phases),
        "actions_lost": sum(ph["actions_lost"] for ph in phases),
        "double_runs": sum(ph["double_runs"] for ph in phases),
        "files_kept": all(ph["files_kept"] for ph in phases),
        "leaks": sum(ph["leaks"] for ph in phases),
        "phases": phases,
    }


ENGINE_FAULTS = {"crash": ["engine_crash"], "sigkill": ["engine_sigkill"], "both": ["engine_crash", "engine_sigkill"]}


class _Counter(dict):
    def __missing__(self, key):
        return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=4, help="trajectories (environments) in the rollout")
    p.add_argument("--steps", type=int, default=12, help="exec actions per trajectory")
    p.add_argument("--step-s", type=float, default=0.3, help="seconds each action sleeps (a window to be hit in)")
    p.add_argument("--cores", type=int, default=2, help="cores of the service's local node")
    p.add_argument("--max-faults", type=int, default=10, help="at most this many faults")
    p.add_argument("--duration-s", type=float, default=600.0,
                   help="no fault after this many seconds (a bound; faults come at seeded action counts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--executor", choices=("local", "docker", "both"), default="both",
                   help="the service's node: local (bubblewrap sandbox), docker (a private Docker Engine, "
                        "killed and restarted too), or both, one after the other")
    p.add_argument("--engine-faults", choices=("crash", "sigkill", "both"), default="both",
                   help="how the Docker engine is killed: crash = dockerd, containerd, shims and containers "
                        "(a machine crash), sigkill = dockerd alone (containerd, a service of its own as in "
                        "distribution packages, and the containers outlive it), both (the default)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args()
    report = asyncio.run(main_async(args))
    ok = report["actions_lost"] == 0 and report["leaks"] == 0 and report["double_runs"] == 0 and report["files_kept"]
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
