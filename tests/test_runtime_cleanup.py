"""A service that ran many actions and trajectories to their end keeps nothing of them but its bounded results.

The service runs for weeks: any per-action, per-trajectory, per-environment, per-request or per-client
entry left behind once the work ended, after a success, failure, timeout, cancel or hang-up, is a leak.
A real service on loopback gets a few hundred actions over HTTP; then every container reachable from
the app (runtime, engine, managers, executors, environment registry, admission gate, waiters, the
connections' deadlines, metrics, state store) is measured by walking the objects' attributes, not a
list of known ones, so state added later is covered too. Each non-empty one must be named below: per
service (its nodes, pools, config: the same size after the run as after a warm-up) or kept up to a
documented cap, which the run passes many times over. The SQLite state is checked the same way, and
again after a restart on it.

Not covered here: http and model actions (tests/test_runtime_cleanup_api.py), Docker and several nodes,
a crash.
"""
from __future__ import annotations

import asyncio
import collections
import random
import sqlite3
import sys
import uuid
from typing import Any

import aiohttp
import pytest

from tangram.policy import memo
from tangram.service.app import GATE_KEY, STATE_KEY, WAITERS_KEY
from tangram.service.recover import RESTARTED, reap_idle
from tests.service_helpers import assert_whole, config, running_service

pytestmark = pytest.mark.timeout(180)

KEEP = 20  # service.keep_results: results the runtime keeps and outcomes the state store keeps
MAX_TOTAL = 24  # service.max_queued_total: also the bound of the gate's outcomes of actions cancelled there
PER_JOB = 12  # service.max_queued_per_job
WINDOW = 4  # service.engine_window: past it, actions wait in the admission gate
KINDS = 3  # exec, http, model
FINAL = ("succeeded", "failed", "timeout", "cancelled")
STATUSES = len(FINAL)
TWO_CORES = [{"name": "local", "executor": "local", "cores": 2, "memory_mb": 4096}]  # the same on every machine

# Per service, not per action or trajectory; each no larger after the run than after a warm-up:
PER_SERVICE = {
    "app.config*": "the cluster config",
    "app.runtime.dispatcher.env_executors": "one executor per CPU node",
    "app.runtime.env_registry.executors": "the same executors",
    "app.runtime.dispatcher.env_executors[*].base_env": "every command's environment variables (config)",
    "app.runtime.listeners": "the state store's and the metrics' listeners",
    "app.runtime.engine.managers": "one manager per resource kind",
    "app.runtime.engine.managers[*]*": "their nodes, pools, NUMA domains, free cores (the holders: "
                                       "assert_whole)",
    "app.runtime.engine._owner": "pool -> its manager",
    "app.runtime.engine._generating._fixed": "one (empty) entry per node",
    "app.runtime.engine._params*": "the policy's knobs (config: scheduler.offered_load_caps, dop_caps)",
    "app.metrics.gc_pauses*": "garbage-collection pauses: a count per bucket and a sum per generation",
}


def _bounded(rt) -> dict[str, int]:
    """Containers that keep finished work, or per-class or per-pool state, up to a cap (pattern -> cap)."""
    from tangram.core.estimator import MAX_CLASSES as ESTIMATED_CLASSES
    from tangram.core.gaps import GAP_WINDOW
    from tangram.core.offered import MAX_KEPT
    from tangram.runtime.loose import MAX_LOOSE_TRAJECTORIES
    from tangram.runtime.stats import _RECENT, MAX_CLASSES

    return {
        "app.runtime._jobs": KEEP,  # service.keep_results: the results GET /v1/actions/{id} answers from
        "app.runtime._finished": KEEP,  # their ids, oldest first
        "app.runtime.engine.finished": KEEP,  # the engine's records of them (service.keep_results too)
        "app.gate._cancelled": MAX_TOTAL,  # outcomes of actions cancelled in the gate: max_queued_total
        # (app.gate._live and _job_of, each job's submitted count and ids, are not here: the runtime tells the
        # gate each end and it forgets the id at once, so nothing of ended work may be left in them)
        "app.gate.refused": 2,  # {429: n, 503: n}
        "app.gate.ended_here": 2,  # {cancelled: n, failed: n}: held actions that ended at the gate
        "app.runtime.loose._seen": MAX_LOOSE_TRAJECTORIES,  # trajectories named by http and model actions
        "app.runtime.statistics.counts": KINDS * STATUSES,  # (kind, status) -> n
        "app.runtime.statistics._act": MAX_CLASSES,  # ACT samples of the most recently finished classes
        "app.runtime.statistics._act[*]": _RECENT * MAX_CLASSES,
        "app.runtime.statistics._overhead": _RECENT,
        "app.runtime.engine.estimator*": ESTIMATED_CLASSES,  # each of its per-class tables
        "app.runtime.engine._last.unfit": len(rt.engine.pool_states()),  # what the last round left: per pool
        # the offered-load books: per elastic type (cpu, gpu), the latest MAX_KEPT to 2 x MAX_KEPT submissions
        "app.runtime.engine._offered*": 2 * (2 * MAX_KEPT + 1),
        # the recent generation gaps (arrival_gap "residual"): the latest GAP_WINDOW, and their sums
        "app.runtime.engine._generating._gaps*": GAP_WINDOW + 1,
    }


_CONTAINERS = (dict, set, list, collections.deque)


def _ours(obj: Any) -> bool:
    return type(obj).__module__.startswith("tangram.")


def _attrs(obj: Any):
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if s not in names]
    for name in names:
        try:
            yield name, getattr(obj, name)
        except AttributeError:
            continue


def _census(app, bounded: dict[str, int]) -> dict[str, int]:
    """path -> total length of every container reachable from ``app``'s values through tangram objects
    (``[*]``: every element of a container, summed); kept results (the bounded containers) are measured,
    not entered."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def visit(obj: Any, path: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, _CONTAINERS):
            out[path] = out.get(path, 0) + len(obj)
            if path in bounded:
                return
            for v in list(obj.values() if isinstance(obj, dict) else obj):
                if _ours(v) or isinstance(v, _CONTAINERS):
                    visit(v, path + "[*]")
            return
        if not _ours(obj) or isinstance(obj, type):
            return
        for name, v in _attrs(obj):
            visit(v, f"{path}.{name}")

    for key in list(app):
        name = getattr(key, "_name", str(key)).rsplit(".", 1)[-1]  # an AppKey's name, else the str key
        visit(app[key], f"app.{name}")
    return out


def _named(path: str, patterns) -> str | None:
    """The pattern naming ``path``: itself, or a prefix of it followed by ``*``."""
    return next((p for p in patterns if path == p or (p.endswith("*") and path.startswith(p[:-1]))), None)


def _module_containers() -> dict[str, int]:
    """Module-level containers of the service's and runtime's modules (a cache there is state too)."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith(("tangram.runtime", "tangram.service", "tangram.executors", "tangram.managers")):
            for attr, v in list(vars(mod).items()):
                if isinstance(v, _CONTAINERS) and not attr.startswith("__"):
                    out[f"{name}.{attr}"] = len(v)
    return out


# ---------------------------------------------------------------------------- #
# the workload, over HTTP


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str):
        self.s = session
        self.url = url
        self.ids: list[str] = []  # every action acknowledged with an id
        self.keys: list[str] = []  # idempotency keys of actions whose client hung up
        self.seen: collections.Counter[str] = collections.Counter()

    async def post(self, body: dict, *, job: str, wait: bool = True, key: str | None = None,
                   hang_up_s: float | None = None) -> dict | None:
        headers = {"X-Tangram-Job": job, **({"Idempotency-Key": key} if key else {})}
        timeout = aiohttp.ClientTimeout(total=hang_up_s) if hang_up_s else aiohttp.ClientTimeout(total=120)
        try:
            async with self.s.post(f"{self.url}/v1/actions?wait={str(wait).lower()}", json=body, headers=headers,
                                   timeout=timeout) as r:
                got = await r.json()
                status = r.status
        except asyncio.TimeoutError:  # the client hung up
            assert hang_up_s is not None
            self.seen["hung up"] += 1
            self.keys.append(key)
            return None
        if status in (429, 503):
            self.seen[f"refused {status}"] += 1
            return None
        assert status in (200, 202), (status, got)
        self.ids.append(got["id"])
        self.seen[got["status"]] += 1
        return got

    async def cancel(self, action_id: str) -> dict:
        async with self.s.delete(f"{self.url}/v1/actions/{action_id}") as r:
            got = await r.json()
            assert r.status in (200, 202), (r.status, got)
        self.seen["cancelled held" if got.get("error") == "cancelled before it started" else "DELETE"] += 1
        return got

    async def wait_final(self, action_id: str, timeout_s: float = 60.0) -> dict:
        """Poll until the action has its final result (generous: the machine may be slow)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            async with self.s.get(f"{self.url}/v1/actions/{action_id}") as r:
                got = await r.json()
                assert r.status == 200, (r.status, got)
            if got["status"] in FINAL or loop.time() > deadline:
                return got
            await asyncio.sleep(0.02)

    async def create_env(self, memory_mb: int) -> str:
        async with self.s.post(f"{self.url}/v1/environments", json={"memory_mb": memory_mb}) as r:
            assert r.status == 201, await r.text()
            return (await r.json())["id"]

    async def delete_env(self, env_id: str) -> None:
        async with self.s.delete(f"{self.url}/v1/environments/{env_id}") as r:
            assert r.status == 204, await r.text()
        self.seen["env deleted"] += 1


def _exec(cmd: str, env: str | None = None, **kw) -> dict:
    return {"kind": "exec", "command": cmd, **({"environment": env} if env else {}), **kw}


async def _one_action(c: Client, rng: random.Random, env: str | None, job: str) -> None:
    k = rng.random()
    if k < 0.55:
        key = uuid.uuid4().hex if rng.random() < 0.3 else None
        await c.post(_exec("echo ok", env), job=job, key=key)
        if key:  # a resubmission is answered, never run again
            await c.post(_exec("echo ok", env), job=job, key=key)
    elif k < 0.7:
        await c.post(_exec("exit 3", env), job=job)
    elif k < 0.8:
        await c.post(_exec("sleep 30", env, timeout_s=0.2), job=job)
    elif k < 0.9:
        got = await c.post(_exec("sleep 30", env), job=job, wait=False)
        if got is not None:
            await asyncio.sleep(rng.choice([0, 0.05]))
            await c.cancel(got["id"])
    else:
        await c.post(_exec("sleep 30", env), job=job, key=uuid.uuid4().hex, hang_up_s=0.3)


async def _trajectory(c: Client, rng: random.Random, t: int, reap: list[str]) -> None:
    env = await c.create_env(rng.choice([0, 64]))
    job = f"job{t % 5}"
    for _ in range(rng.randint(4, 10)):
        await _one_action(c, rng, env, job)
    end = rng.random()
    if end < 0.4:
        await c.delete_env(env)
    elif end < 0.8:  # deleted with actions in it: running, queued, held at the gate
        for _ in range(3):
            await c.post(_exec("sleep 30", env), job=job, wait=False)
        await c.delete_env(env)
    else:  # left for the lease reaper
        reap.append(env)


async def _held_burst(c: Client) -> None:
    """Fill the service to max_queued_total (two cores, an engine window of 4: most wait in the gate) with
    a 429 and a 503 on the way; delete an environment whose actions are held (they fail when handed
    over); then cancel everything, the newest first (still held: a cancelled running one lets the gate
    hand the next over)."""
    env = await c.create_env(0)
    ids = [await c.post(_exec("sleep 30"), job=f"burst{i % 2}", wait=False) for i in range(PER_JOB * 2 - 3)]
    ids.append(await c.post(_exec("sleep 30"), job="burst0", wait=False))  # its 12th unfinished
    assert None not in ids, dict(c.seen)
    assert await c.post(_exec("true"), job="burst0", wait=False) is None  # its 13th: 429
    orphans = [await c.post(_exec("sleep 30", env), job="orphans", wait=False) for _ in range(2)]
    assert all(o is not None and o["status"] == "waiting" for o in orphans), orphans
    assert await c.post(_exec("true"), job="other", wait=False) is None  # the 25th: 503
    await c.delete_env(env)  # its actions held in the gate were not its active ones
    for got in reversed(ids):
        await c.cancel(got["id"])
    for o in orphans:
        got = await c.wait_final(o["id"])
        assert got["status"] == "failed" and got["error"].startswith("not started"), got
        c.seen["not started"] += 1


async def _workload(c: Client, svc, rng: random.Random) -> list[str]:
    """Trajectories in environments, one-shot actions, bursts; returns the environments left open."""
    reap: list[str] = []
    for wave in range(3):
        await asyncio.gather(*(_trajectory(c, rng, 8 * wave + t, reap) for t in range(8)))
        # one-shot environments (no environment named), a job each: more jobs than the gate's bound
        await asyncio.gather(*(_one_action(c, rng, None, f"oneshot{wave}-{i}") for i in range(24)))
    while c.seen["cancelled held"] <= MAX_TOTAL:  # past the bound of what the gate keeps of them
        await _quiet(svc, disconnected=False)  # hung-up clients' actions ended: the bounds below are exact
        await _held_burst(c)
    return reap


async def _until(cond, what: str, timeout_s: float = 60.0) -> None:
    """Wait (generously: no timed assert) until ``cond()``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"never {what}")
        await asyncio.sleep(0.01)


async def _quiet(svc, *, disconnected: bool = True, timeout_s: float = 60.0) -> None:
    """Wait (generously: no timed assert) until nothing runs, waits, is held or cleaned up; with
    ``disconnected``, also until every connection closed and its requests ended (a client keeps its
    idle connections open: close its session first)."""
    rt, app = svc.runtime, svc.app
    gate = app[GATE_KEY]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        busy = {"running": len(rt.engine.running), "waiting": len(rt.engine.waiting), "held": gate.stats()["held"],
                "cleanups": len(rt.env_registry.cleanups)}
        if disconnected:
            busy.update(connections=len(svc.runner.server.connections), waiters=len(app[WAITERS_KEY]))
        if not any(busy.values()):
            return
        if loop.time() > deadline:
            raise AssertionError(f"not quiet after {timeout_s} s: {busy}")
        await asyncio.sleep(0.02)


def _rows(db: sqlite3.Connection) -> dict[str, Any]:
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    out: dict[str, Any] = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in tables}
    out["actions by status"] = dict(db.execute("SELECT status, COUNT(*) FROM actions GROUP BY status").fetchall())
    out["actions without outcome"] = db.execute(
        "SELECT COUNT(*) FROM actions WHERE outcome IS NULL AND status != 'expired'").fetchone()[0]
    out["restarted"] = db.execute("SELECT COUNT(*) FROM actions WHERE outcome LIKE ?",
                                  (f"%{RESTARTED}%",)).fetchone()[0]
    return out


def _check_containers(svc, warm: dict[str, int], per_service: dict[str, str] = PER_SERVICE,
                      bounded: dict[str, int] | None = None) -> dict[str, int]:
    """Every container is empty, per service (no larger than after the warm-up) or within its cap."""
    bounded = _bounded(svc.runtime) if bounded is None else bounded
    left = {p: n for p, n in _census(svc.app, bounded).items() if n}
    unnamed = {p: n for p, n in left.items() if not _named(p, per_service) and not _named(p, bounded)}
    assert unnamed == {}, "per-action, per-trajectory or per-request state left behind"
    grown = {p: (warm.get(p, 0), n) for p, n in left.items() if _named(p, per_service) and n > warm.get(p, 0)}
    assert grown == {}, "per-service containers grew with the work"
    over = {p: (n, bounded[_named(p, bounded)]) for p, n in left.items()
            if _named(p, bounded) and n > bounded[_named(p, bounded)]}
    assert over == {}, "kept past their cap"
    return left


async def test_nothing_of_ended_actions_and_environments_is_left(tmp_path):
    cfg = config(cpu_nodes=TWO_CORES, service={
        "state_dir": str(tmp_path / "state"), "keep_results": KEEP, "max_queued_total": MAX_TOTAL,
        "max_queued_per_job": PER_JOB, "engine_window": WINDOW})
    rng = random.Random(7)
    async with running_service(cfg) as svc:
        rt, store = svc.runtime, svc.app[STATE_KEY]
        async with aiohttp.ClientSession() as s:
            c = Client(s, svc.url)
            env = await c.create_env(64)  # a warm-up: whatever is made per node on first use exists after it
            for cmd in ("true", "exit 1"):
                await c.post(_exec(cmd, env), job="warm")
                await c.post(_exec(cmd), job="warm")
            await c.delete_env(env)
            await _quiet(svc, disconnected=False)
            warm, modules_warm = _census(svc.app, _bounded(rt)), _module_containers()
            reap = await _workload(c, svc, rng)
            await _quiet(svc, disconnected=False)
            # a handler forgets its request before it answers, or once cancelled (its client hung up):
            # nothing waits for an action any more, whether or not the client closed its connections
            assert svc.app[WAITERS_KEY] == {}
        await _quiet(svc)
        assert sorted(await reap_idle(store, rt, 0.0)) == sorted(reap)  # the lease reaper, every lease past
        await _quiet(svc)
        assert_whole(rt)
        for what in ("succeeded", "failed", "timeout", "hung up", "DELETE", "cancelled held", "not started",
                     "env deleted", "refused 429", "refused 503"):
            assert c.seen[what], f"the run had no {what!r}: {dict(c.seen)}"
        assert len(c.ids) + len(c.keys) > 10 * KEEP  # past every cap below

        left = _check_containers(svc, warm)
        assert left["app.runtime._jobs"] == KEEP and left["app.gate._cancelled"] == MAX_TOTAL  # reached, held
        assert all(j.outcome is not None and j.task is None for j in rt._jobs.values())
        finished = {id(r.action) for r in rt.engine.finished.values()}  # the policy's memos let go of them
        assert not any(finished & m.keys() for m in memo._MEMOS)

        # the durable state: no environment, no action without its outcome, outcomes and ids within the cap
        rows = _rows(store.db)
        assert rows["environments"] == 0 and rows["actions without outcome"] == 0, rows
        assert rows["meta"] == 2, rows  # schema_version, service_id
        assert sum(n for st, n in rows["actions by status"].items() if st != "expired") <= KEEP + KEEP // 10, rows
        assert rows["actions"] <= 10 * KEEP + KEEP // 10, rows  # trimmed every KEEP // 10 outcomes
        assert set(rows) - {"actions by status", "actions without outcome", "restarted"} == {
            "meta", "environments", "actions", "sqlite_sequence"}, rows  # a new table: say what bounds it

        # an id a client was given: its final result, 410 once no longer kept, 404 once forgotten (10 x KEEP)
        hung_up = [a for a in map(store.action_for_key, c.keys) if a is not None]
        async with aiohttp.ClientSession() as s:
            for aid in c.ids + hung_up:
                async with s.get(f"{svc.url}/v1/actions/{aid}") as r:
                    body = await r.json()
                    assert r.status in (200, 404, 410), (r.status, body)
                    assert r.status != 200 or body["status"] in FINAL, body
                    assert r.status != 200 or aid not in hung_up or body["status"] == "cancelled", body
        await _quiet(svc)
        _check_containers(svc, warm)
    grown = {k: (modules_warm.get(k, 0), n) for k, n in _module_containers().items() if n > modules_warm.get(k, 0)}
    assert grown == {}, "module-level state grew with the work"

    # a restart on the same state: nothing was in flight, no environment to reattach, nothing kept in memory
    async with running_service(cfg) as svc:
        rows = _rows(svc.app[STATE_KEY].db)
        assert rows["environments"] == 0 and rows["restarted"] == 0, rows
        _check_containers(svc, warm)
