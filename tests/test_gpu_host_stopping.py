"""A remote GPU host that has not stopped an action's call when its cancel's settle time is up keeps the action's
chunk taken (``GpuManager.detain``) until it has: the next action on those GPUs never finds them busy."""
from __future__ import annotations

import asyncio
import functools
import sys
import types

import pytest

from tangram.core.grants import Chunk
from tangram.core.model import Action, Demand
from tangram.executors.base import TIMEOUT
from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec
from tangram.runtime.gpu import GpuRunner
from tangram.scaleout import ray_gpu
from tests.service_helpers import until

GB = 1024
POOL = "gpu@g0"


def _manager() -> GpuManager:
    return GpuManager([GpuNode("g0", 8, 80 * GB)], [ModelSpec("m", 10 * GB)])


def _request(aid: str, dop: int = 4) -> Action:
    return Action.build(aid, {"gpu": Demand.fixed(dop)}, service="m", payload={"model": "m", "op": "embed"})


def test_a_detained_chunk_is_the_managers_own_until_released():
    gm = _manager()
    chunk = gm.allocate(POOL, 4, "a1", _request("a1"))  # a miss: its restore is not confirmed
    key = gm.detain(POOL, "a1")
    assert key is not None and key != "a1"
    assert gm.held() == {POOL: {}}  # not an engine grant any more
    assert gm.buddy("g0").allocated() == [chunk]  # but taken: no plan sees it free
    st = gm.stats()
    assert st["stopping"] == 1 and st["failed_restores"] == 1  # the abandoned restore is not resident
    assert st["nodes"][POOL]["stopping"] == 1
    from tangram.service.metrics import _gpu_metrics

    gauge = next(f for f in _gpu_metrics(st) if f.name == "tangram_gpu_chunks_stopping")
    assert [(s.labels, s.value) for s in gauge.samples] == [({"pool": POOL}, 1)]
    assert not gm.cache("g0").is_resident("m@dop4", chunk)
    gm.check_invariants()
    assert gm.release(POOL, "a1") is False  # the engine's release of the action finds nothing
    assert gm.buddy("g0").allocated() == [chunk]
    assert gm.release(POOL, key) is True
    assert gm.buddy("g0").allocated() == [] and gm.stats()["stopping"] == 0
    assert gm.detain(POOL, "a1") is None  # nothing held: nothing to keep
    gm.check_invariants()


class _Ref:
    """The ObjectRef of a host call that answers after ``run_s``; a cancel takes it ``stop_s`` to obey."""

    def __init__(self, run_s: float, stop_s: float):
        self.fut = asyncio.get_running_loop().create_future()
        self.stop_s = stop_s
        self.stopped = False
        self._answer = asyncio.get_running_loop().call_later(run_s, self._set, {"status": "succeeded"})

    def _set(self, value):
        if not self.fut.done():
            self.fut.set_result(value)

    def cancel(self):
        self._answer.cancel()
        asyncio.get_running_loop().call_later(self.stop_s, self._stop)

    def _stop(self):
        self.stopped = True
        if not self.fut.done():
            self.fut.set_exception(RuntimeError("TaskCancelledError"))

    def __await__(self):
        return asyncio.shield(self.fut).__await__()


def _runner(monkeypatch, run_s: float, stop_s: float, settle_s: float = 0.2):
    refs: list[_Ref] = []

    def remote(*args):
        refs.append(_Ref(run_s, stop_s))
        return refs[-1]

    actor = types.SimpleNamespace(execute=types.SimpleNamespace(remote=remote))
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(cancel=lambda ref: ref.cancel()))
    monkeypatch.setattr(ray_gpu, "_CANCEL_SETTLE_S", settle_s)
    gm = _manager()
    runner = GpuRunner(gm, ray_gpu.RemoteHost(ray_gpu.RayHandle(actor, "tangram-gpu-g0"), "g0"), POOL)
    rounds: list[int] = []
    runner.on_free = lambda: rounds.append(1)
    return gm, runner, refs, rounds


_until = functools.partial(until, timeout_s=5.0)


async def test_a_timed_out_call_whose_host_has_not_stopped_keeps_its_chunk_until_it_has(monkeypatch):
    gm, runner, refs, rounds = _runner(monkeypatch, run_s=30.0, stop_s=0.6)
    chunk = gm.allocate(POOL, 4, "a1", _request("a1"))
    res = await runner.run(_request("a1"), None, timeout_s=0.1)
    assert res.status == TIMEOUT
    assert not refs[0].stopped  # the settle time (0.2 s) is up, the host still runs there
    gm.release(POOL, "a1")  # the engine ends the action
    assert gm.buddy("g0").allocated() == [chunk] and gm.stats()["stopping"] == 1
    gm.check_invariants()
    assert rounds == []
    await _until(lambda: refs[0].stopped)
    await _until(lambda: not gm.buddy("g0").allocated())
    assert gm.stats()["stopping"] == 0 and rounds == [1]  # back, and the round runs to use it
    gm.check_invariants()


async def test_a_cancelled_call_whose_host_has_not_stopped_keeps_its_chunk_until_it_has(monkeypatch):
    gm, runner, refs, rounds = _runner(monkeypatch, run_s=30.0, stop_s=0.6)
    chunk = gm.allocate(POOL, 4, "a1", _request("a1"))
    task = asyncio.ensure_future(runner.run(_request("a1"), None))
    await _until(lambda: refs)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gm.release(POOL, "a1")
    assert gm.buddy("g0").allocated() == [chunk] and not refs[0].stopped
    await _until(lambda: not gm.buddy("g0").allocated())
    assert refs[0].stopped and rounds == [1]
    gm.check_invariants()


async def test_a_host_that_stops_within_the_settle_time_gives_the_chunk_back_with_the_action(monkeypatch):
    gm, runner, refs, rounds = _runner(monkeypatch, run_s=30.0, stop_s=0.05, settle_s=1.0)
    gm.allocate(POOL, 4, "a1", _request("a1"))
    res = await runner.run(_request("a1"), None, timeout_s=0.1)
    assert res.status == TIMEOUT and refs[0].stopped
    assert gm.release(POOL, "a1") is True  # still the action's grant: the engine's release frees it
    assert gm.buddy("g0").allocated() == [] and gm.stats()["stopping"] == 0 and rounds == []


async def test_a_warm_load_whose_host_has_not_stopped_keeps_its_chunk_until_it_has(monkeypatch):
    from tangram.runtime import gpu as runtime_gpu

    gm, runner, refs, rounds = _runner(monkeypatch, run_s=30.0, stop_s=0.6)
    monkeypatch.setattr(runtime_gpu, "WARM_LOAD_TIMEOUT_S", 0.1)
    plan = gm.warm_plan("g0")
    runner.start_warm(lambda: None)
    await asyncio.wait_for(runner._warm, 10)  # every load timed out
    assert len(refs) >= 1 and not all(r.stopped for r in refs)
    assert gm.buddy("g0").allocated()  # the loads' hosts still run: their chunks stay taken
    st = gm.stats()
    assert st["stopping"] == len(gm.buddy("g0").allocated()) and st["warming"] == 0  # kept, not loading
    await _until(lambda: all(r.stopped for r in refs))
    await _until(lambda: not gm.buddy("g0").allocated())
    assert runner.warm_loads == 0 and gm.cache("g0").instances() == [] and plan
    gm.check_invariants()
    await runner.close()


def test_a_chunk_kept_for_a_stopping_host_is_not_free_to_the_policy():
    gm = _manager()
    gm.allocate(POOL, 8, "a1", _request("a1", 8))
    gm.detain(POOL, "a1")
    (state,) = list(gm.pool_states())
    assert state.free == 0 and state.chunks == ()
    assert Chunk(0, 8) in gm.buddy("g0").allocated()


async def test_through_the_runtime_an_action_after_a_timed_out_one_waits_until_its_host_has_stopped(monkeypatch):
    """The dispatcher's safety net ends a timed-out model action 2 s after its timeout, before the host's
    settle time is up (and before ``wait_for`` hands its cancel on, on Python 3.10 and 3.11): the chunk
    is still kept, and the next action on those GPUs starts only once the host has stopped."""
    from tangram.core.engine import Engine
    from tangram.runtime import dispatch
    from tangram.runtime.driver import Runtime

    refs: list[_Ref] = []
    started_after_stop: list[bool] = []

    def remote(*args):
        started_after_stop.append(all(r.stopped for r in refs))
        refs.append(_Ref(30.0 if not refs else 0.01, 0.8))
        return refs[-1]

    actor = types.SimpleNamespace(execute=types.SimpleNamespace(remote=remote))
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(cancel=lambda ref: ref.cancel()))
    monkeypatch.setattr(ray_gpu, "_CANCEL_SETTLE_S", 5.0)
    monkeypatch.setattr(dispatch, "TIMEOUT_GRACE_S", 0.05)
    gm = _manager()
    runner = GpuRunner(gm, ray_gpu.RemoteHost(ray_gpu.RayHandle(actor, "tangram-gpu-g0"), "g0"), POOL)
    rt = Runtime(Engine([gm]), model_executors={"g0": runner}, models={"m"})
    assert runner.on_free == rt.tick  # the runtime wires the round to a kept chunk's return
    try:
        a = rt.submit(rt.build_action("model", {"gpu": 8}, payload={"model": "m"}, timeout_s=0.1))
        b = rt.submit(rt.build_action("model", {"gpu": 8}, payload={"model": "m"}))
        first = await asyncio.wait_for(rt.wait(a), 3)
        assert first.status == "timeout" and not refs[0].stopped
        assert gm.stats()["stopping"] == 1 and len(refs) == 1  # b waits: the host still runs on the GPUs
        second = await asyncio.wait_for(rt.wait(b), 5)
        assert second.status == "succeeded" and refs[0].stopped and started_after_stop == [True, True]
        assert gm.stats()["stopping"] == 0
        gm.check_invariants()
    finally:
        await rt.close()


def test_an_action_id_run_again_while_its_last_run_still_stops_gets_a_chunk_kept_apart():
    gm = _manager()
    gm.allocate(POOL, 4, "a1", _request("a1"))
    first = gm.detain(POOL, "a1")
    chunk = gm.allocate(POOL, 4, "a1", _request("a1"))  # the same id again (an in-process caller's own id)
    assert gm.detain(POOL, "a1", Chunk(4 - chunk.start, 4)) is None  # another run's chunk: not taken
    second = gm.detain(POOL, "a1", chunk)
    assert first != second and gm.stats()["stopping"] == 2
    gm.check_invariants()
    assert gm.release(POOL, first) and gm.release(POOL, second)
    assert gm.buddy("g0").allocated() == []


@pytest.mark.parametrize("cancels", [1, 2])
async def test_behind_a_scaleout_nodes_guard_a_cancelled_call_keeps_its_chunk_even_cancelled_twice(monkeypatch, cancels):
    """A scale-out GPU node's runner sits behind its node guard: a second cancel (a second DELETE, a shutdown
    after one) is handed on and waited through, so the runner keeps the chunk before the action ends and
    the engine releases it."""
    from tangram.core.engine import Engine
    from tangram.scaleout.cluster import ClusterRuntime
    from tangram.scaleout.gate import DownNodes, gate_all

    gm, runner, refs, rounds = _runner(monkeypatch, run_s=30.0, stop_s=1.0, settle_s=5.0)
    runner.on_free = None  # the runtime wires its own round
    down = DownNodes()
    rt = ClusterRuntime(Engine(gate_all([gm], down)), down=down, model_executors={"g0": runner}, models={"m"})
    try:
        a = rt.submit(rt.build_action("model", {"gpu": 8}, payload={"model": "m"}))
        await _until(lambda: refs)
        for _ in range(cancels):
            rt.cancel(a)
            await asyncio.sleep(0.05)
        out = await asyncio.wait_for(rt.wait(a), 8)
        assert out.status == "cancelled"
        if cancels == 1:  # the cancel waited for the host to stop (within the settle time)
            assert refs[0].stopped and not gm.buddy("g0").allocated() and gm.stats()["stopping"] == 0
        else:  # the second cancel ended the wait: the action ended first, its chunk kept
            assert not refs[0].stopped
            assert gm.buddy("g0").allocated() == [Chunk(0, 8)] and gm.stats()["stopping"] == 1
        await _until(lambda: refs[0].stopped and not gm.buddy("g0").allocated())
        assert gm.stats()["stopping"] == 0
        gm.check_invariants()
    finally:
        await rt.close()
