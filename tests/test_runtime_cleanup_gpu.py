"""What tests/test_runtime_cleanup_api.py leaves out: a GPU restore that raises, and a restart with work in flight.

1. A model whose restore raises (its factory fails before its CPU master copy is built; then the copy onto
   a device fails, on one device of two, slowly while the action times out or is DELETEd once or twice, at
   random among concurrent actions) and then succeeds: the GPU manager keeps no holder, lease or busy device, the
   service cache and the executor's device copies name the same resident instances, and the cache's
   device memory is what those copies take; nothing per action is left (the census of
   tests/test_runtime_cleanup.py) and SQLite has no action without its outcome.
2. A service stopped while http and model actions run, wait behind a busy pool or a 429 pause, or are held
   at the admission gate, restarted on the same state directory: every action was stored with its final
   status before the restart (the ones cut by the shutdown cancelled, app._cancel_in_flight; none left for
   the restart to answer failed/retryable), every id answers it after the restart, a resubmitted
   Idempotency-Key gets it back without running again, and nothing is in flight or held in either service.

Not covered: a restore that fails on a hit whose device copy the executor lost (a Ray host that restarted;
no in-process run loses one: the books would keep the instance), a remote (Ray) GPU host, a kill -9 with
model or http actions in flight (tests/test_crash_recovery.py does exec actions).
"""
from __future__ import annotations

import asyncio
import random
import sqlite3
import threading
import time
import uuid

import aiohttp
import pytest

from tangram.core.grants import parse_service
from tangram.managers.basic import BasicManager
from tangram.managers.gpu import GpuManager
from tangram.service.app import GATE_KEY, STATE_KEY, WAITERS_KEY
from tests.service_helpers import assert_whole, config, running_service
from tests.test_runtime_cleanup import (
    FINAL,
    KEEP,
    MAX_TOTAL,
    PER_JOB,
    TWO_CORES,
    Client,
    _census,
    _check_containers,
    _quiet,
    _until,
    _rows,
)
from tests.test_runtime_cleanup_api import (
    EXECUTOR,
    GPU_MB,
    GPUS,
    LONG,
    LOOSE,
    MODEL_MB,
    PER_SERVICE_HERE,
    POOLS,
    Upstream,
    _bounded_here,
    _check_books,
    _drain_quota,
    _http,
    _model,
)

pytestmark = pytest.mark.timeout(180)

OK_ROW = [[1.0, 2.0, 3.0]]


class _Flaky:
    """How the flaky model's next factory calls and device copies go (the executor runs them in threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.factory_fails = 0  # the next n factory calls raise (no CPU master copy yet)
        self.plan: list[str] = []  # the next device copies: "ok", "fail", "slow-fail" (slow_s, then raise)
        self.rate = 0.0  # past the plan, the chance a copy fails
        self.rng = random.Random(5)
        self.failed = 0  # copies that raised
        self.slow_s = 1.0  # how long a "slow-fail" copy takes (a DELETE must land meanwhile on a loaded machine)

    def copy(self) -> None:
        with self.lock:
            what = self.plan.pop(0) if self.plan else ("fail" if self.rng.random() < self.rate else "ok")
            if what != "ok":
                self.failed += 1
        if what == "slow-fail":
            time.sleep(self.slow_s)
        if what != "ok":
            raise RuntimeError("CUDA out of memory (simulated)")


FLAKY = _Flaky()


def make_flaky():
    import torch

    with FLAKY.lock:
        if FLAKY.factory_fails:
            FLAKY.factory_fails -= 1
            raise OSError("cannot read the checkpoint (simulated)")

    class Flaky(torch.nn.Linear):
        def to_empty(self, *, device, recurse=True):  # the executor's copy of the master onto a device
            FLAKY.copy()
            return super().to_empty(device=device, recurse=recurse)

    torch.manual_seed(0)
    return Flaky(3, 1)


def _gpu_config(tmp_path, models: dict[str, str], *, warm_start: bool = False, **service):
    """A node of virtual GPUs serving ``models``; cold by default, as these tests count a request's own
    restores, evictions and failures."""
    services = [{"name": n, "state_mb": MODEL_MB, "options": {"factory": f}} for n, f in models.items()]
    return config(cpu_nodes=TWO_CORES, api_pools=POOLS, gpu_nodes=[
        {"name": "g0", "gpus": GPUS, "device": "cpu", "memory_mb_per_gpu": GPU_MB, "services": services,
         "warm_start": warm_start}],
        service={"state_dir": str(tmp_path / "state"), "keep_results": KEEP, "max_queued_total": MAX_TOTAL,
                 "max_queued_per_job": PER_JOB, **service})


def _check_device_memory(rt) -> None:
    """The cache's free memory per device is the capacity minus the device copies there (ground truth:
    the executor's), and the pool's view says the same resident services."""
    gpu = next(m for m in rt.engine.managers if isinstance(m, GpuManager))
    for pool, cache in gpu._cache.items():
        host = rt.model_executors[pool.removeprefix("gpu@")].host
        copies = [0] * GPUS
        for (service, start), replicas in host._replicas.items():
            assert len(replicas) == parse_service(service)[1], (service, start)
            for d in range(start, start + len(replicas)):
                copies[d] += 1
        assert [cache.free_mb(d) for d in range(GPUS)] == [GPU_MB - MODEL_MB * n for n in copies], (
            pool, sorted(host._replicas))
        state = next(p for p in gpu.pool_states() if p.name == pool)
        assert (state.free, set(state.resident)) == (GPUS, {s for s, _ in host._replicas}), state
        cache.check()


async def _until_status(c: Client, aid: str, status: str) -> None:
    while True:
        async with c.s.get(f"{c.url}/v1/actions/{aid}") as r:
            got = await r.json()
        if got["status"] == status:
            return
        assert got["status"] not in FINAL, got
        await asyncio.sleep(0.01)


async def test_a_restore_that_raises_leaves_nothing_behind(tmp_path):
    pytest.importorskip("torch")
    cfg = _gpu_config(tmp_path, {"flaky": "tests.test_runtime_cleanup_gpu:make_flaky",
                                 "scorer": "tests.test_runtime_cleanup_api:make_scorer"}, engine_window=8)
    async with running_service(cfg) as svc:
        rt, store = svc.runtime, svc.app[STATE_KEY]
        rt.loose.limit = LOOSE  # the calls name their trajectories (test_runtime_cleanup_api)
        gpu = next(m for m in rt.engine.managers if isinstance(m, GpuManager))
        async with aiohttp.ClientSession() as s:
            c = Client(s, svc.url)
            for g in (1, 2, 1):  # a warm-up: the scorer restored, evicted, restored
                assert (await c.post(_model("scorer", OK_ROW, g), job="warm"))["status"] == "succeeded"
            await _quiet(svc, disconnected=False)
            warm = _census(svc.app, _bounded_here(rt))
            warm[f"{EXECUTOR}._masters"] += 1  # the flaky model's master copy is built in the run

            restore_failed: list[dict] = []

            async def run(body: dict, *, expect: str | None = "failed", job: str = "flaky") -> dict:
                got = await c.post(body, job=job)
                assert got is not None
                if got["status"] not in FINAL:
                    got = await c.wait_final(got["id"])
                if expect is not None:
                    assert got["status"] == expect, got
                if "restore failed" in (got.get("error") or ""):
                    restore_failed.append(got)
                return got

            FLAKY.factory_fails = 2  # no master copy yet: both restores fail before any device is touched
            await run(_model("flaky", OK_ROW, 1))
            await run(_model("flaky", OK_ROW, 2))
            FLAKY.plan = ["fail"]  # the master is built, its copy onto the device fails
            await run(_model("flaky", OK_ROW, 1))
            await run(_model("scorer", OK_ROW, 2), expect="succeeded")  # resident on both devices
            FLAKY.plan = ["ok", "fail"]  # evicts the scorer, copies onto one device, fails on the other
            await run(_model("flaky", OK_ROW, 2))
            await run(_model("scorer", OK_ROW, 1), expect="succeeded")
            FLAKY.plan = ["slow-fail"]  # the action times out while the copy is under way, which then fails
            await run(_model("flaky", OK_ROW, 1, timeout_s=0.2), expect=None)
            FLAKY.plan = ["ok", "slow-fail"]  # DELETEd while the copy is under way, which then fails
            got = await c.post(_model("flaky", OK_ROW, 2), job="flaky", wait=False)
            await _until_status(c, got["id"], "running")
            await c.cancel(got["id"])
            assert (await c.wait_final(got["id"]))["status"] == "cancelled"
            # DELETEd twice while the copy is under way: the second DELETE must not end the action (and free
            # its devices) before the worker on them stopped
            FLAKY.plan = ["slow-fail"]
            got = await c.post(_model("flaky", OK_ROW, 2), job="flaky", wait=False)
            await _until_status(c, got["id"], "running")
            first = asyncio.ensure_future(c.cancel(got["id"]))
            await asyncio.sleep(0.1)
            assert (await c.cancel(got["id"]))["status"] == "cancelled"
            assert (await first)["status"] == "cancelled"
            await run(_model("scorer", OK_ROW, 2), expect="succeeded")  # on the same devices, now free
            assert FLAKY.failed == 5 and len(restore_failed) == 5, (FLAKY.failed, restore_failed)

            # concurrent: half the flaky restores fail while the other device restores, runs or is idle
            FLAKY.plan, FLAKY.rate, before = ["fail"], 0.5, FLAKY.failed
            rng = random.Random(3)
            await asyncio.gather(*(run(_model(rng.choice(("flaky", "scorer")), OK_ROW * 8, rng.choice((1, 1, 2))),
                                       expect=None, job=f"flaky{i % 2}") for i in range(16)))
            assert FLAKY.failed > before, "no restore failed in the concurrent part"
            assert all(got["status"] == "failed" for got in restore_failed)

            FLAKY.rate = 0.0  # then the same model succeeds: restored at each DoP, then a hit
            for g in (1, 2, 2):
                await run(_model("flaky", OK_ROW, g), expect="succeeded")
            # a last failed restore (it evicts flaky@dop2), then another model: no later run of the same
            # service heals books or devices that kept it (the executor restores a hit it lacks)
            FLAKY.plan = ["fail"]
            await run(_model("flaky", OK_ROW, 1))
            await run(_model("scorer", OK_ROW, 1), expect="succeeded")
            await _quiet(svc, disconnected=False)
            assert svc.app[WAITERS_KEY] == {}
        await _quiet(svc)
        assert_whole(rt)
        await _drain_quota(next(m for m in rt.engine.managers if isinstance(m, BasicManager)))
        _check_device_memory(rt)
        _check_books(rt)  # no holder, lease or busy device; the cache's resident instances are the device copies
        _check_containers(svc, warm, PER_SERVICE_HERE, _bounded_here(rt))
        rows = _rows(store.db)
        assert rows["environments"] == 0 and rows["actions without outcome"] == 0, rows
        # every failed restore (and the DELETEd one) was a miss the books forgot; the last success stays
        stats = gpu.stats()
        assert stats["failed_restores"] >= len(restore_failed) + 1 and stats["hits"] and stats["evictions"], stats
        assert sorted(rt.model_executors["g0"].host._replicas) == sorted(gpu.cache("g0")._resident), "books"
        assert {s for s, _ in rt.model_executors["g0"].host._replicas} == {"scorer@dop1"}


@pytest.mark.parametrize("warm_start", [False, True], ids=["cold", "warm"])
async def test_a_restart_after_a_shutdown_with_work_in_flight(tmp_path, warm_start):
    pytest.importorskip("torch")
    cfg = _gpu_config(tmp_path, {"scorer": "tests.test_runtime_cleanup_api:make_scorer",
                                 "slow": "tests.test_runtime_cleanup_api:make_slow"}, engine_window=3,
                      warm_start=warm_start)
    final: dict[str, str] = {}  # id -> the status it must answer after the restart
    keys: dict[str, tuple[str, dict]] = {}  # Idempotency-Key -> id, body
    async with Upstream() as up:
        async with aiohttp.ClientSession() as s:
            async with running_service(cfg) as svc:
                rt, gate = svc.runtime, svc.app[GATE_KEY]
                rt.loose.limit = LOOSE
                c = Client(s, svc.url)

                async def post(body: dict, job: str, *, key: str | None = None, **kw) -> str:
                    got = await c.post(body, job=job, key=key, **kw)
                    assert got is not None, dict(c.seen)
                    if key:
                        keys[key] = got["id"], body
                    if got["status"] in FINAL:
                        final[got["id"]] = got["status"]
                    return got["id"]

                # ended before the shutdown
                for body in (_http(f"{up.url}/ok", "search"), _http(f"{up.url}/fail", "fixed"),
                             _model("scorer", OK_ROW, 2), _model("scorer", [[1.0, 2.0]], 1)):
                    await post(body, "done", key=uuid.uuid4().hex)
                assert sorted(final.values()) == ["failed", "failed", "succeeded", "succeeded"], final

                # cut by the shutdown: running, waiting behind a busy GPU or a 429 pause, held at the gate
                cut = [await post(_http(f"{up.url}/slow", "search"), "http", wait=False)]
                await _until(lambda: up.slow == 1, "the slow call reached the upstream")
                key, waited = uuid.uuid4().hex, _http(f"{up.url}/slow", "fixed")  # a client waiting for its call
                waiting = asyncio.ensure_future(c.post(waited, job="wait", key=key))
                await _until(lambda: up.slow == 2, "the waited-for call reached the upstream")
                cut.append(await post(_http(f"{up.url}/pause", "paused"), "http", wait=False))
                await _until(lambda: rt.upstream_429s_absorbed.get("api:paused"), "the pool paused")
                cut.append(await post(_http(f"{up.url}/ok", "paused"), "http", wait=False, key=uuid.uuid4().hex))
                cut.append(await post(_model("slow", LONG, 2), "gpu", wait=False, key=uuid.uuid4().hex))
                await _until_status(c, cut[-1], "running")
                cut.append(await post(_model("scorer", OK_ROW, 1), "gpu", wait=False))  # waits for a device
                await _until(lambda: len(rt.engine.waiting) == 3, "three actions waiting in the engine")
                for body in (_model("scorer", OK_ROW, 1), _http(f"{up.url}/ok", "fixed")):
                    cut.append(await post(body, "held", wait=False, key=uuid.uuid4().hex))
                assert gate.stats()["held"] == 2, gate.stats()
                assert not any(aid in final for aid in cut)
                final.update(dict.fromkeys(cut, "cancelled"))
            answered = await waiting  # answered with its final result, not a dropped connection
            assert answered is not None and answered["status"] == "cancelled", answered
            keys[key] = answered["id"], waited
            final[answered["id"]] = "cancelled"

            # the stopped service: nothing ran, waited or was held; every grant came back
            assert (rt.engine.running, rt.engine.waiting, gate.stats()["held"]) == ({}, {}, 0)
            assert all(j.outcome is not None for j in rt._jobs.values())
            assert_whole(rt)
            gpu = next(m for m in rt.engine.managers if isinstance(m, GpuManager))
            assert all((gpu._holders[p], cache._leases, cache._busy) == ({}, {}, {}) for p, cache in gpu._cache.items())
            assert rt.model_executors["g0"].host._busy == {}  # the cancelled model's worker stopped
            # and stored every action with its outcome: none left for the restart to answer failed/retryable
            db = sqlite3.connect(tmp_path / "state" / "state.sqlite3")
            try:
                stored = dict(db.execute("SELECT id, status FROM actions WHERE outcome IS NOT NULL").fetchall())
                unfinished = db.execute("SELECT COUNT(*) FROM actions WHERE outcome IS NULL").fetchone()[0]
            finally:
                db.close()
            assert unfinished == 0 and stored == final, (unfinished, stored, final)
        await _until(lambda: up.slow == 0, "the upstream saw the cut calls' connections close")

        async with running_service(cfg) as svc:  # the same state, restarted
            rt, gate = svc.runtime, svc.app[GATE_KEY]
            rt.loose.limit = LOOSE
            gpu = next(m for m in rt.engine.managers if isinstance(m, GpuManager))
            # a warm start's loads are the node's own, not an action's: the census below runs after its plan
            runner = rt.model_executors["g0"]
            await _until(lambda: runner._warm is None or runner._warm.done(), "the warm start's plan ended")
            assert (gpu.stats()["warm_loads"] > 0) == warm_start and not gpu.stats()["warming"]
            rows = _rows(svc.app[STATE_KEY].db)
            assert rows["restarted"] == 0 and rows["actions without outcome"] == 0, rows
            # nothing in memory of the actions before the restart (the census's per-service containers are
            # the ones the service makes on first use: only unnamed ones and caps are checked here)
            _check_containers(svc, _census(svc.app, _bounded_here(rt)), PER_SERVICE_HERE, _bounded_here(rt))
            async with aiohttp.ClientSession() as s:
                c = Client(s, svc.url)
                for aid, status in final.items():
                    async with s.get(f"{svc.url}/v1/actions/{aid}") as r:
                        body = await r.json()
                        assert r.status == 200 and body["status"] == status, (status, r.status, body)
                for key, (aid, body) in keys.items():  # answered from the state, never run again
                    got = await c.post(body, job="again", key=key, wait=False)
                    assert (got["id"], got["status"]) == (aid, final[aid]), (got, final[aid])
                assert up.slow == 0 and not rt.engine.running and not rt.engine.waiting and gate.stats()["held"] == 0
                assert_whole(rt)
                _check_books(rt)
                # the restarted service works: the paused pool is not paused any more, the GPUs are free
                for body in (_http(f"{up.url}/ok", "paused"), _model("scorer", OK_ROW, 2)):
                    assert (await c.post(body, job="after"))["status"] == "succeeded"
            await _quiet(svc)
            assert_whole(rt)
            await _drain_quota(next(m for m in rt.engine.managers if isinstance(m, BasicManager)))
            _check_books(rt)
            _check_containers(svc, _census(svc.app, _bounded_here(rt)), PER_SERVICE_HERE, _bounded_here(rt))
            rows = _rows(svc.app[STATE_KEY].db)
            assert rows["restarted"] == 0 and rows["actions without outcome"] == 0, rows
