"""http and model actions leave nothing behind either (tests/test_runtime_cleanup.py does exec actions).

A real service on loopback calls a local upstream through three API pools (concurrency, a sliding and a
fixed quota window, an upstream that pauses a pool) and runs models on two virtual GPUs (torch on the
CPU, two models that evict each other). The calls succeed, fail (500, refused connection, a model on
bad inputs), time out, are DELETEd, hung up on, answered 429 (re-queued, or returned past the
deadline, or cancelled while the pool is paused). Then every container reachable from the app is
measured as in tests/test_runtime_cleanup.py, the managers' per-grant books more strictly: the basic
manager keeps no holder, in-flight grant, counted grant or expiry once a quota period passed, the GPU
manager no holder, lease or busy device, its service cache and the executor's device copies only the
resident services, the same ones, within what the devices hold.

A restore that raises and a restart with http and model work in flight: tests/test_runtime_cleanup_gpu.py.
Not covered: scale-out GPU hosts (Ray), the simulated GPU executor, the idle connections aiohttp keeps to
the upstream (only that no call the service gave up on stays open there).
"""
from __future__ import annotations

import asyncio
import itertools
import random
import uuid

import aiohttp
import pytest
from aiohttp import web

from tangram.managers.basic import BasicManager
from tangram.managers.gpu import GpuManager
from tangram.service.app import STATE_KEY, WAITERS_KEY
from tests.service_helpers import assert_whole, config, running_service
from tests.test_runtime_cleanup import (
    FINAL,
    KEEP,
    MAX_TOTAL,
    PER_JOB,
    PER_SERVICE,
    TWO_CORES,
    Client,
    _bounded,
    _census,
    _check_containers,
    _module_containers,
    _quiet,
    _until,
    _rows,
)

pytestmark = pytest.mark.timeout(180)

PERIOD = 0.2  # the quota pools' period: their books must be empty one period after the last call
POOLS = {
    "search": {"concurrency": 3, "quota": 8, "period_s": PERIOD},  # sliding window
    "fixed": {"concurrency": 2, "quota": 5, "period_s": PERIOD, "window": "fixed"},
    "paused": {"concurrency": 1},  # its upstream asks for a long pause: an action cancelled meanwhile
}
GPUS, GPU_MB, MODEL_MB = 2, 64, 40  # one model per device: the two evict each other
MODELS = ("scorer", "slow")
BATCH_S = 0.02  # the slow model's time per batch of 32 (a cancel or timeout stops it between batches)
LONG = [[1.0, 2.0, 3.0]] * (32 * 100)  # ~2 s on the slow model: cancelled or timed out long before


def make_scorer():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def make_slow():
    import time

    import torch

    class Slow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x):
            time.sleep(BATCH_S)
            return self.lin(x)

    return Slow()


class Upstream:
    """A loopback API: ``/ok``, ``/fail`` (500), ``/slow`` (60 s), ``/busy?k=`` (429 + Retry-After at
    the first call of each k, as if another client shared the key; 200 after), ``/refuse`` (always
    429 + Retry-After 0.3 s), ``/pause`` (429 + Retry-After 30 s)."""

    def __init__(self):
        self.busy_seen: set[str] = set()
        self.answered_429 = {"busy": 0, "refuse": 0, "pause": 0}
        self.slow = 0  # calls open now: a call the service gave up on must close its connection

    async def handle(self, request: web.Request) -> web.Response:
        what = request.match_info["what"]
        limited = {"X-RateLimit-Limit": "8", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "0.05"}
        if what == "ok":
            return web.json_response({"ok": True}, headers={"X-RateLimit-Remaining": "3"})
        if what == "fail":
            return web.json_response({"error": "boom"}, status=500)
        if what == "slow":
            self.slow += 1
            try:
                await asyncio.sleep(60)
            finally:
                self.slow -= 1
        if what == "busy":
            k = request.query["k"]
            if k not in self.busy_seen:
                self.busy_seen.add(k)
                self.answered_429["busy"] += 1
                return web.json_response({"error": "busy"}, status=429, headers={**limited, "Retry-After": "0.05"})
            return web.json_response({"ok": True})
        if what in ("refuse", "pause"):
            self.answered_429[what] += 1
            return web.json_response({"error": what}, status=429,
                                     headers={"Retry-After": "0.3" if what == "refuse" else "30"})
        return web.json_response({"error": "no such path"}, status=404)

    async def __aenter__(self) -> "Upstream":
        app = web.Application()
        app.router.add_get("/{what}", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)  # a closed connection ends its call
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


# every call names one of TRAJECTORIES rollouts (the order's generation credit), and the runtime keeps the
# books of LOOSE of them: names past it are closed, so what the engine keeps per trajectory stays bounded
TRAJECTORIES, LOOSE = 12, 4
_NAMES = itertools.count()


def _http(url: str, pool: str, **kw) -> dict:
    kw.setdefault("trajectory", f"traj-{next(_NAMES) % TRAJECTORIES}")
    return {"kind": "http", "url": url, "resources": {"api": pool}, **kw}


def _model(model: str, inputs: list, gpus: int = 1, **kw) -> dict:
    kw.setdefault("trajectory", f"traj-{next(_NAMES) % TRAJECTORIES}")
    return {"kind": "model", "model": model, "op": "score", "inputs": inputs, "resources": {"gpu": gpus}, **kw}


# what each action of a wave does (fixed, so that every case happens: only the model and DoP are drawn)
HTTP_CASES = ("ok", "ok-key", "fail", "ok", "no-connection", "timeout", "delete", "busy", "delete", "hang-up",
              "busy", "refuse", "busy", "ok")
MODEL_CASES = ("ok", "fail", "timeout", "delete", "hang-up", "ok")


async def _one_http(c: Client, up: Upstream, case: str, pool: str, job: str) -> None:
    if case in ("ok", "ok-key"):
        key = uuid.uuid4().hex if case == "ok-key" else None
        await c.post(_http(f"{up.url}/ok", pool), job=job, key=key)
        if key:  # a resubmission is answered, never sent again
            await c.post(_http(f"{up.url}/ok", pool), job=job, key=key)
    elif case == "fail":
        await c.post(_http(f"{up.url}/fail", pool), job=job)
    elif case == "no-connection":
        await c.post(_http("http://127.0.0.1:1/", pool), job=job)
    elif case == "timeout":
        await c.post(_http(f"{up.url}/slow", pool, timeout_s=0.2), job=job)
    elif case == "delete":
        got = await c.post(_http(f"{up.url}/slow", pool), job=job, wait=False)
        if got is not None:
            await asyncio.sleep(0.05 if pool == "search" else 0)
            await c.cancel(got["id"])
    elif case == "hang-up":
        await c.post(_http(f"{up.url}/slow", pool), job=job, key=uuid.uuid4().hex, hang_up_s=0.3)
    elif case == "busy":
        got = await c.post(_http(f"{up.url}/busy?k={uuid.uuid4().hex}", pool), job=job)
        assert got is None or got["status"] == "succeeded", got  # the 429 was absorbed
    else:  # its Retry-After passes its deadline: the 429 is the answer
        got = await c.post(_http(f"{up.url}/refuse", pool, timeout_s=0.2), job=job)
        assert got is None or (got["status"], got["error"]) == ("failed", "HTTP 429"), got


async def _one_model(c: Client, case: str, rng: random.Random, job: str) -> None:
    model, gpus = rng.choice(MODELS), rng.choice([1, 1, 2])
    if case == "ok":
        got = await c.post(_model(model, [[1.0, 2.0, 3.0]] * 4, gpus), job=job)
        assert got is None or got["status"] == "succeeded", got
    elif case == "fail":  # the wrong input width: fails in the model, after a restore it never confirms
        await c.post(_model(model, [[1.0, 2.0]], gpus), job=job)
    elif case == "timeout":
        await c.post(_model("slow", LONG, gpus, timeout_s=0.2), job=job)
    elif case == "delete":
        got = await c.post(_model("slow", LONG, gpus), job=job, wait=False)
        if got is not None:
            await asyncio.sleep(rng.choice([0, 0.1]))
            await c.cancel(got["id"])
    else:
        await c.post(_model("slow", LONG, gpus), job=job, key=uuid.uuid4().hex, hang_up_s=0.3)


async def _paused(c: Client, up: Upstream, rt) -> None:
    """A 429 asking for 30 s pauses its pool; the action, re-queued meanwhile, is cancelled; so is the
    next one, queued behind the pause."""
    first = await c.post(_http(f"{up.url}/pause", "paused"), job="paused", wait=False)
    while not rt.upstream_429s_absorbed.get("api:paused"):  # re-queued: no timed assert (the test's timeout)
        await asyncio.sleep(0.01)
    second = await c.post(_http(f"{up.url}/ok", "paused"), job="paused", wait=False)
    for got in (first, second):
        assert (await c.cancel(got["id"]))["status"] == "cancelled"


# the managers' containers by name (tests/test_runtime_cleanup.py covers them all with managers[*]*)
MANAGERS = "app.runtime.engine.managers[*]"
EXECUTOR = "app.runtime.dispatcher.model_executors[*].host"
INSTANCES = GPUS * (GPU_MB // MODEL_MB)  # instances the devices hold at once
PER_SERVICE_HERE = {
    **{p: why for p, why in PER_SERVICE.items() if p != f"{MANAGERS}*"},
    f"{MANAGERS}": "one manager per resource kind",
    f"{MANAGERS}.nodes": "GPU nodes",
    f"{MANAGERS}._nodes*": "CPU nodes, their NUMA domains and free cores",
    f"{MANAGERS}._pools": "CPU, memory and API pools (their books: below, empty)",
    f"{MANAGERS}._buddy": "a buddy allocator per GPU node",
    f"{MANAGERS}._buddy[*]._free": "its free chunks (all of them: as after the warm-up)",
    f"{MANAGERS}._cache": "a service cache per GPU node",
    f"{MANAGERS}._cache[*]._used_mb": "memory used per device",
    f"{MANAGERS}._cache[*].models": "the configured models",
    f"{MANAGERS}._holders": "one (empty) holder table per GPU node",
    f"{MANAGERS}._restores": "one count of restores by source per GPU node",
    "app.runtime.dispatcher.model_executors": "a model runner per GPU node",
    f"{EXECUTOR}.devices": "its devices",
    f"{EXECUTOR}._masters": "each model's CPU master copy, built at the start",
}


def _bounded_here(rt) -> dict[str, int]:
    return {**_bounded(rt),
            f"{MANAGERS}._cache[*]._resident": INSTANCES,  # resident services: what the devices hold
            f"{MANAGERS}._cache[*]._last_use": INSTANCES,  # their LRU order
            f"{MANAGERS}._cache[*].stats_.by_service": len(MODELS) * 2,  # per service: model x DoP (1, 2)
            f"{EXECUTOR}._replicas": INSTANCES,  # the device copies of the resident services
            "app.runtime.upstream_429s_absorbed": len(POOLS),  # per pool
            "app.runtime.loose._seen": LOOSE,  # the trajectories named last: their books are kept
            "app.runtime.engine._generating._done": LOOSE,
            "app.runtime.engine._generating._generated": LOOSE,
            "app.runtime.engine._generating._since": LOOSE}


async def _drain_quota(m: BasicManager) -> None:
    """Let the upstream's windows forget every call (a sleep past the last release + one period: no
    timed assert), then refresh the books."""
    grants = [g for p in m._pools.values() for g in p.grants.values()]
    assert all(g.released is not None for g in grants), "a grant still in flight"
    ends = [g.released + PERIOD for g in grants] + [e for p in m._pools.values() for e, _, _ in p.expiry]
    await asyncio.sleep(max([0.0] + [t - m.clock() for t in ends]) + 0.01)
    list(m.pool_states())  # refresh(now)


def _check_books(rt) -> None:
    """The managers' per-grant books are empty; the GPU cache and the devices agree on what is resident."""
    basic = next(m for m in rt.engine.managers if isinstance(m, BasicManager))
    books = {p.name: {"holders": p.holders, "live": p.live, "grants": p.grants, "expiry": p.expiry,
                      "in_flight": p.in_flight, "consumed": p.consumed} for p in basic._pools.values()}
    left = {name: {k: v for k, v in b.items() if v} for name, b in books.items()}
    assert not any(left.values()), left
    gpu = next(m for m in rt.engine.managers if isinstance(m, GpuManager))
    for pool, cache in gpu._cache.items():
        assert (gpu._holders[pool], cache._leases, cache._busy) == ({}, {}, {}), pool
        assert gpu._buddy[pool].free_devices == GPUS
        assert set(cache._last_use) == set(cache._resident) and len(cache._resident) <= INSTANCES
        host = rt.model_executors[pool.removeprefix("gpu@")].host
        assert host._busy == {}
        assert sorted(host._replicas) == sorted(cache._resident)  # no device copy the books forgot, nor the reverse


async def test_nothing_of_ended_http_and_model_actions_is_left(tmp_path):
    pytest.importorskip("torch")
    services = [{"name": n, "state_mb": MODEL_MB, "options": {"factory": f"tests.test_runtime_cleanup_api:make_{n}"}}
                for n in MODELS]
    cfg = config(cpu_nodes=TWO_CORES, api_pools=POOLS, gpu_nodes=[
        {"name": "g0", "gpus": GPUS, "device": "cpu", "memory_mb_per_gpu": GPU_MB, "services": services}],
        service={"state_dir": str(tmp_path / "state"), "keep_results": KEEP, "max_queued_total": MAX_TOTAL,
                 "max_queued_per_job": PER_JOB, "engine_window": 8})
    rng = random.Random(11)
    async with Upstream() as up, running_service(cfg) as svc:
        rt, store = svc.runtime, svc.app[STATE_KEY]
        rt.loose.limit = LOOSE  # reached within the warm-up: the run's names are closed as it goes
        basic = next(m for m in rt.engine.managers if isinstance(m, BasicManager))
        async with aiohttp.ClientSession() as s:
            c, cm = Client(s, svc.url), Client(s, svc.url)  # http and model actions
            for pool in POOLS:  # a warm-up: whatever is made per pool or service on first use
                await c.post(_http(f"{up.url}/ok", pool), job="warm")
            # and a failed restore, restores, evictions (one model per device) and a hit, whatever the run does
            for body in (_model("scorer", [[1.0, 2.0]]), *(_model(m, [[1.0, 2.0, 3.0]], g) for m in MODELS
                                                           for g in (1, 2)), _model("slow", [[1.0, 2.0, 3.0]], 2)):
                await cm.post(body, job="warm")
            await _quiet(svc, disconnected=False)
            await _drain_quota(basic)
            warm, modules_warm = _census(svc.app, _bounded_here(rt)), _module_containers()
            for wave in range(6):  # fewer at once than max_queued_total
                await asyncio.gather(
                    *(_one_http(c, up, case, ("search", "fixed")[(i + wave) % 2], f"job{i % 4}")
                      for i, case in enumerate(HTTP_CASES)),
                    *(_one_model(cm, case, rng, f"gpu{i % 2}") for i, case in enumerate(MODEL_CASES)))
            await _paused(c, up, rt)
            # a last failed restore: no later run restores what books that kept it believe resident
            await cm.post(_model("slow", [[1.0, 2.0, 3.0]], 2), job="last")
            assert (await cm.post(_model("scorer", [[1.0, 2.0]], 2), job="last"))["status"] == "failed"
            await _quiet(svc, disconnected=False)
            assert svc.app[WAITERS_KEY] == {}
        await _quiet(svc)
        await _until(lambda: up.slow == 0, "calls closed at the upstream (every abandoned call's connection)",
                     timeout_s=20)
        for seen in (c.seen, cm.seen):
            assert all(seen[w] for w in ("succeeded", "failed", "timeout", "hung up")), (dict(c.seen), dict(cm.seen))
            assert seen["DELETE"] + seen["cancelled held"], (dict(c.seen), dict(cm.seen))
        gpu = next(m for m in rt.engine.managers if isinstance(m, GpuManager)).stats()
        assert all(gpu[k] for k in ("hits", "restores", "evictions", "failed_restores")), gpu
        assert all(up.answered_429.values()), up.answered_429
        assert len(c.ids + c.keys + cm.ids + cm.keys) > 5 * KEEP
        # every 429 re-queued, but the ones whose pause would pass their deadline
        assert sum(rt.upstream_429s_absorbed.values()) == up.answered_429["busy"] + up.answered_429["pause"]

        assert_whole(rt)
        await _drain_quota(basic)
        _check_books(rt)
        _check_containers(svc, warm, PER_SERVICE_HERE, _bounded_here(rt))
        rows = _rows(store.db)
        assert rows["environments"] == 0 and rows["actions without outcome"] == 0, rows
        assert sum(n for st, n in rows["actions by status"].items() if st != "expired") <= KEEP + KEEP // 10, rows
        assert rows["actions"] <= 10 * KEEP + KEEP // 10, rows
        async with aiohttp.ClientSession() as s:  # every id a client was given: final, gone or forgotten
            for aid in c.ids + cm.ids:
                async with s.get(f"{svc.url}/v1/actions/{aid}") as r:
                    body = await r.json()
                    assert r.status in (404, 410) or (r.status == 200 and body["status"] in FINAL), body
        await _quiet(svc)
        _check_containers(svc, warm, PER_SERVICE_HERE, _bounded_here(rt))
    grown = {k: (modules_warm.get(k, 0), n) for k, n in _module_containers().items() if n > modules_warm.get(k, 0)}
    assert grown == {}, "module-level state grew with the work"
