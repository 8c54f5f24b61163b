"""A GPU node's warm start: its plan (tangram.managers.gpu_warm), the manager's warm loads, the simulator's."""
from __future__ import annotations

import asyncio
import copy
from dataclasses import replace

import pytest

from tangram.core.grants import Chunk
from tangram.core.model import Action, Demand
from tangram.managers.base import AllocationError
from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec
from tangram.managers.gpu_warm import warm_plan
from tangram.simulator.policies import policy_spec
from tangram.simulator.sim import Simulation
from tangram.simulator.workload import builtin_raw, parse_workload

GB = 1024


def _models(**sizes_gb) -> list[ModelSpec]:
    return [ModelSpec(n, state_mb=s * GB, sharded=True) for n, s in sizes_gb.items()]


def test_the_plan_is_widest_first_largest_first_and_never_overfills_a_device():
    plan = warm_plan(8, 80 * GB, _models(small=15, big=60))
    assert plan[:2] == [("big@dop8", Chunk(0, 8)), ("small@dop8", Chunk(0, 8))]
    dops = [c.size for _, c in plan]
    assert dops == sorted(dops, reverse=True)
    used = [0] * 8
    sizes = {"small": 15 * GB, "big": 60 * GB}
    for service, chunk in plan:
        model, dop = service.split("@dop")
        for d in chunk.devices:
            used[d] += -(-sizes[model] // int(dop))
    assert max(used) <= 80 * GB
    # what is left on a device is less than the smallest instance the plan skipped there
    assert ("big@dop1", Chunk(0, 1)) not in plan and 80 * GB - used[0] < 60 * GB
    assert len(set(plan)) == len(plan)


def test_the_plan_counts_what_is_resident_and_loads_it_once():
    models = _models(m=40)
    first = warm_plan(2, 80 * GB, models)
    assert first == [("m@dop2", Chunk(0, 2)), ("m@dop1", Chunk(0, 1)), ("m@dop1", Chunk(1, 1))]
    # 60 GB are in use on device 0 (20 + 40): a second m@dop1 there would not fit
    again = warm_plan(2, 80 * GB, models, resident=[("m@dop2", Chunk(0, 2)), ("m@dop1", Chunk(0, 1))])
    assert again == [("m@dop1", Chunk(1, 1))]
    assert warm_plan(4, 80 * GB, _models(huge=400)) == []  # fits nowhere: nothing planned


def _manager() -> GpuManager:
    return GpuManager([GpuNode("g0", 8, 80 * GB)], _models(small=15, big=60))


def _request(aid: str, model: str, dop: int) -> Action:
    return Action.build(aid, {"gpu": Demand.fixed(dop)}, service=model)


def test_a_warm_load_holds_its_exact_chunk_and_leaves_its_instance_resident():
    gm = _manager()
    plan = gm.warm_plan("g0")
    service, chunk = next((s, c) for s, c in plan if c == Chunk(4, 4))
    decision = gm.warm("g0", "w1", service, chunk)
    assert decision is not None and not decision.hit and decision.chunk == chunk
    assert gm.buddy("g0").allocated() == [chunk]
    assert gm.held() == {"gpu@g0": {}}  # a warm load is the manager's own, not an engine grant
    gm.check_invariants()
    with pytest.raises(AllocationError):
        gm.warm("g0", "w1", service, chunk)  # one holder, one load
    assert gm.stats()["warming"] == 1
    gm.restored("g0", "w1", 0.5)
    gm.restored("g0", "w1", 0.5)  # confirmed once, counted once
    assert gm.release("gpu@g0", "w1")
    st = gm.stats()
    assert (st["warm_loads"], st["warm_restore_s"], st["warming"], st["restores"], st["misses"]) == (1, 0.5, 0, 1, 1)
    assert st["hit_rate"] is None  # no request yet: the warm load's miss is not the requests'
    assert gm.cache("g0").is_resident(service, chunk) and gm.buddy("g0").allocated() == []
    # a request of that service at that DoP takes the warm instance: a hit, no restore
    got = gm.allocate("gpu@g0", 4, "r1", _request("r1", service.split("@")[0], 4))
    assert got == chunk and gm.lease("gpu@g0", "r1").hit
    assert gm.stats()["hit_rate"] == 1.0 and gm.stats()["nodes"]["gpu@g0"]["hit_rate"] == 1.0
    assert gm.warm_plan("g0") == [p for p in plan if p != (service, chunk)]  # loaded once


def test_a_warm_load_takes_nothing_where_a_request_holds_its_chunk_or_it_no_longer_fits():
    gm = _manager()
    gm.allocate("gpu@g0", 1, "r1", _request("r1", "small", 1))  # device 0
    assert gm.warm("g0", "w1", "big@dop8", Chunk(0, 8)) is None
    assert gm.warm("g0", "w2", "big@dop4", Chunk(0, 4)) is None
    assert gm.buddy("g0").allocated() == [Chunk(0, 1)] and gm.held() == {"gpu@g0": {"r1": Chunk(0, 1)}}
    assert gm.warm("g0", "w3", "big@dop4", Chunk(4, 4)) is not None  # the other half is free
    gm.release("gpu@g0", "w3")  # unconfirmed: forgotten, as a failed restore is
    assert not gm.cache("g0").is_resident("big@dop4", Chunk(4, 4))
    gm.release("gpu@g0", "r1")
    # 60 + 15 GB already on device 2 (big@dop1 and small@dop1 loaded by requests): big@dop1 again does not fit
    for aid, model in (("r2", "big"), ("r3", "small")):
        gm.allocate("gpu@g0", 1, aid, _request(aid, model, 1))
        gm.restored("gpu@g0", aid, 1.0)
        gm.release("gpu@g0", aid)
    where = gm.cache("g0").chunks_of("big@dop1")[0]
    assert gm.warm("g0", "w4", "small@dop2", Chunk(where.start - where.start % 2, 2)) is None


def _mopd_skewed(batch: int) -> object:
    raw = copy.deepcopy(builtin_raw("mopd-skewed"))
    raw["trajectories"] = batch
    return parse_workload(raw, source="mopd-skewed")


def test_the_simulators_warm_start_loads_before_the_requests_and_keeps_the_books():
    wl = _mopd_skewed(64)
    cold = Simulation(wl, replace(policy_spec("tangram"), gpu_warm=False), seed=0, check=True).run().summary
    warm = Simulation(wl, policy_spec("tangram"), seed=0, check=True).run().summary  # the default
    assert "gpu_warm_loads" not in cold and warm["gpu_warm_loads"] > 0
    # the loads are restores; the requests' own restores are fewer, their hits more
    assert warm["gpu_restores"] - warm["gpu_warm_loads"] < cold["gpu_restores"]
    assert warm["gpu_cache_hits"] > cold["gpu_cache_hits"]
    assert warm["actions"] == cold["actions"] and warm["failed"] == cold["failed"] == 0
    # the loads' GPU-seconds are busy and reserved beside the requests' own
    res = Simulation(wl, replace(policy_spec("tangram"), gpu_warm=True), seed=0).run()
    requests = sum(r.units * r.run_s for r in res.records if r.rtype == "gpu")
    gpu = res.summary["pools"]["gpu"]
    assert res.summary["gpu_warm_gpu_s"] > 0
    assert gpu["busy_unit_s"] == pytest.approx(requests + res.summary["gpu_warm_gpu_s"], abs=0.01)


def test_a_request_during_the_warm_start_goes_before_the_next_load():
    """Generation of 0.01 s: the first requests come while the nodes load; none waits for the whole plan."""
    raw = copy.deepcopy(builtin_raw("mopd-skewed"))
    raw["trajectories"] = 16
    raw["generation_s"] = 0.01
    wl = parse_workload(raw, source="mopd-skewed")
    res = Simulation(wl, replace(policy_spec("tangram"), gpu_warm=True), seed=0, check=True).run()
    assert res.summary["gpu_warm_loads"] > 0
    # a node's first load (its largest teacher at DoP 8) takes under a second at 25 GB/s, its whole plan
    # several: the earliest request starts after the load under way, not after the plan
    assert min(r.start for r in res.records) < 1.0


@pytest.mark.timeout(120)
async def test_a_live_node_with_warm_start_loads_its_models_and_a_first_request_hits():
    """A real service, a node of 4 virtual GPUs (torch on CPU) with two models: the warm start loads each at
    DoP 4, 2 and 1 where it fits (here: everywhere), and a first request finds its instance resident."""
    pytest.importorskip("torch")
    from tests.service_helpers import assert_whole, config, running_service

    services = [{"name": n, "state_mb": 100, "options": {"factory": "tests.test_service_kinds:make_scorer"}}
                for n in ("a", "b")]
    cfg = config(gpu_nodes=[{"name": "g0", "gpus": 4, "device": "cpu", "memory_mb_per_gpu": 1024,
                             "warm_start": True, "services": services}])
    assert cfg.gpu_nodes[0].warm_start is True
    async with running_service(cfg) as svc, svc.client() as c:
        runner = svc.runtime.model_executors["g0"]
        await asyncio.wait_for(runner._warm, 60)
        gm = runner.manager
        want = {(f"{m}@dop{k}", s) for m in ("a", "b") for k in (4, 2, 1) for s in range(0, 4, k)}
        assert {(i.service, i.chunk.start) for i in gm.cache("g0").instances()} == want
        assert runner.warm_loads == len(want) == gm.stats()["restores"]
        assert gm.buddy("g0").allocated() == []  # every load gave its chunk back
        r = await c.run_action({"kind": "model", "model": "a", "op": "score", "inputs": [[1.0, 2.0, 3.0]]})
        assert r.ok, r.error
        assert gm.stats()["hits"] == 1 and gm.stats()["misses"] == len(want)  # the request restored nothing
        # the operator sees the warm loads apart from the requests' restores
        gpu = (await c.stats())["gpu"]
        assert (gpu["warm_loads"], gpu["restores"], gpu["warming"]) == (len(want), len(want), 0)
        assert gpu["hit_rate"] == 1.0 and gpu["nodes"]["gpu@g0"]["warm_loads"] == len(want)
        assert 0 < gpu["warm_restore_s"] == pytest.approx(gpu["restore_s"])
        metrics = await (await c._sess().get(f"{svc.url}/metrics")).text()
        assert f'tangram_gpu_restores_total{{pool="gpu@g0",source="warm"}} {float(len(want))}' in metrics
        assert 'tangram_gpu_restores_total{pool="gpu@g0",source="request"} 0.0' in metrics
        assert 'tangram_gpu_cache_hits_total{pool="gpu@g0"} 1.0' in metrics
        assert_whole(svc.runtime)


def test_warm_start_is_a_boolean_in_the_config():
    from tangram.core.errors import ConfigError
    from tests.service_helpers import config

    from tangram.service.config import warm_start_on

    def node(**m):
        return config(gpu_nodes=[{"name": "g0", "gpus": 1, **m}]).gpu_nodes[0]

    # unset: on where the devices are CUDA devices, off on virtual CPU devices (the host's own memory)
    assert node().warm_start is None and node(device="cpu").warm_start is None
    assert warm_start_on(node(device="cuda"), cuda_visible=False) is True
    assert warm_start_on(node(), cuda_visible=True) is True and warm_start_on(node(), cuda_visible=False) is False
    assert warm_start_on(node(device="cpu"), cuda_visible=True) is False
    assert warm_start_on(node(device="cpu", warm_start=True), cuda_visible=False) is True
    assert warm_start_on(node(device="cuda", warm_start=False), cuda_visible=True) is False
    with pytest.raises(ConfigError) as e:
        config(gpu_nodes=[{"name": "g0", "gpus": 1, "device": "cpu", "warm_start": "yes please"}])
    assert e.value.field == "gpu_nodes[0].warm_start"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device, cuda, warm", [(None, True, True), (None, False, False), ("cpu", True, False)])
async def test_the_service_s_build_warm_starts_a_node_as_warm_start_on_says(monkeypatch, device, cuda, warm):
    """The build asks ``warm_start_on`` with what this process sees of CUDA (patched: there is none here)."""
    pytest.importorskip("torch")
    import tangram.service.build as build
    from tangram.service.build import build_runtime
    from tests.service_helpers import config

    monkeypatch.setattr(build, "_cuda_visible", lambda: cuda)
    node = {"name": "g0", "gpus": 1, "memory_mb_per_gpu": 1024, "services": [
        {"name": "a", "state_mb": 100, "options": {"factory": "tests.test_service_kinds:make_scorer"}}]}
    if device is not None:
        node["device"] = device
    monkeypatch.setattr(torch_cuda(), "is_available", lambda: False)  # the node's devices: virtual, here
    rt = await build_runtime(config(gpu_nodes=[node]))
    try:
        runner = rt.model_executors["g0"]
        assert (runner._warm is not None) == warm
        if warm:
            await asyncio.wait_for(runner._warm, 60)
            assert runner.manager.stats()["warm_loads"] == 1
    finally:
        await rt.close()


def torch_cuda():
    import torch

    return torch.cuda


async def test_a_service_closed_during_its_warm_start_holds_nothing_after():
    pytest.importorskip("torch")
    from tests.service_helpers import config, running_service

    services = [{"name": n, "state_mb": 100, "options": {"factory": "tests.test_service_kinds:make_scorer"}}
                for n in ("a", "b", "c")]
    cfg = config(gpu_nodes=[{"name": "g0", "gpus": 8, "device": "cpu", "memory_mb_per_gpu": 4096,
                             "warm_start": True, "services": services}])
    async with running_service(cfg) as svc:
        runner = svc.runtime.model_executors["g0"]
        await asyncio.sleep(0)  # the warm start is under way: its first loads hold their chunks
        assert runner._warm is not None and not runner._warm.done()
    assert runner._warm.done()
    gm = runner.manager
    assert gm.buddy("g0").allocated() == [] and gm.held() == {"gpu@g0": {}}
    assert not gm.cache("g0").busy()
    gm.check_invariants()


class _Host:
    """A model host that answers each load as told, after ``delay_s`` (its stop takes ``stop_s``)."""

    def __init__(self, status: str = "succeeded", delay_s: float = 0.0, stop_s: float = 0.0):
        self.status, self.delay_s, self.stop_s = status, delay_s, stop_s
        self.timeouts: list = []
        self.stopped = False

    async def execute(self, decision, payload, *, timeout_s=None):
        from tangram.executors.base import ExecResult

        self.timeouts.append(timeout_s)
        assert payload["inputs"] == [] and payload["model"] == decision.model
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            from tangram.executors.base import wait_through_cancels

            # stopping a restore takes a moment, whatever cancels come meanwhile (as the torch host's)
            await wait_through_cancels(asyncio.ensure_future(asyncio.sleep(self.stop_s)))
            self.stopped = True
            raise
        return ExecResult(status=self.status, restored=self.status == "succeeded", restore_s=0.01)


async def test_a_load_is_bounded_and_one_that_fails_leaves_nothing_resident_or_held():
    from tangram.runtime.gpu import WARM_LOAD_TIMEOUT_S, GpuRunner

    gm = _manager()
    host = _Host(status="timeout")
    runner = GpuRunner(gm, host, "gpu@g0")
    rounds = []
    runner.start_warm(lambda: rounds.append(1))
    await asyncio.wait_for(runner._warm, 10)
    assert host.timeouts and set(host.timeouts) == {WARM_LOAD_TIMEOUT_S}
    assert runner.warm_loads == 0 and gm.cache("g0").instances() == [] and gm.buddy("g0").allocated() == []
    assert len(rounds) >= 1  # the runtime's round ran after the loads ended
    await runner.close()


async def test_a_cancel_while_closing_still_gives_the_loads_chunks_back():
    """A close that is itself cancelled (a shutdown that timed out) while a load stops: the chunk goes back,
    and not before the host has stopped copying onto it."""
    from tangram.runtime.gpu import GpuRunner

    gm = _manager()
    host = _Host(delay_s=10.0, stop_s=0.3)
    runner = GpuRunner(gm, host, "gpu@g0")
    released = []
    release = gm.release

    def recorded(pool, holder):
        released.append((holder, host.stopped))
        return release(pool, holder)

    gm.release = recorded
    runner.start_warm(lambda: None)
    await asyncio.sleep(0.01)
    assert gm.buddy("g0").allocated()  # a load holds its chunk
    closing = asyncio.ensure_future(runner.close())
    await asyncio.sleep(0.01)
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    await asyncio.gather(runner._warm, return_exceptions=True)
    for _ in range(100):
        if not gm.buddy("g0").allocated():
            break
        await asyncio.sleep(0.01)
    assert gm.buddy("g0").allocated() == [] and not gm.cache("g0").busy()
    assert released and all(stopped for _, stopped in released), released
    gm.check_invariants()


def test_tangram_simulate_warm_start_loads_under_tangrams_gpu_manager_only(capsys):
    import json

    from tangram.cli import main

    assert main(["simulate", "--workload", "mopd-skewed", "--policy", "all", "--batch", "32", "--warm-start",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by = {r["policy"]: r for r in out["results"]}
    assert by["tangram"]["gpu_warm_loads"] > 0
    assert "gpu_warm_loads" not in by["static-services"] and "gpu_warm_loads" not in by["serverless"]
    assert main(["simulate", "--workload", "mopd-skewed", "--batch", "32", "--json"]) == 0  # the default: warm
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == by["tangram"]
    assert main(["simulate", "--workload", "mopd-skewed", "--batch", "32", "--cold-start", "--json"]) == 0
    cold = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "gpu_warm_loads" not in cold and cold["mean_act_s"] != by["tangram"]["mean_act_s"]
    with pytest.raises(SystemExit):  # one or the other
        main(["simulate", "--workload", "mopd-skewed", "--warm-start", "--cold-start"])


async def test_a_node_that_dies_mid_load_ends_its_warm_start_and_its_chunk_waits_for_the_host_to_stop():
    """Scale-out: the node's down signal ends its warm start, as it ends its actions. The load under way is
    stopped, its chunk goes back only once the host has stopped (not while it may still copy onto it), and
    no other load begins."""
    from tangram.runtime.gpu import GpuRunner

    gm = _manager()
    host = _Host(delay_s=60.0, stop_s=0.5)
    down = asyncio.Event()
    taken, released = [], []
    warm, release = gm.warm, gm.release

    def counted(*args):
        decision = warm(*args)
        taken.append(decision is not None)
        return decision

    def recorded(pool, holder):
        released.append(host.stopped)
        return release(pool, holder)

    gm.warm, gm.release = counted, recorded
    runner = GpuRunner(gm, host, "gpu@g0")
    runner.start_warm(lambda: None, down=lambda: down)
    await asyncio.sleep(0.05)
    begun = sum(taken)
    assert begun >= 1 and len(host.timeouts) == begun and gm.buddy("g0").allocated() != []
    down.set()
    await asyncio.sleep(0.2)  # the host is still stopping: its chunk is still held
    assert not host.stopped and gm.buddy("g0").allocated() != []
    await asyncio.wait_for(runner._warm, 5)  # not the load's 60 s, nor its 600 s bound
    assert host.stopped and released == [True] * begun and sum(taken) == begun  # none begun after
    assert runner.warm_loads == 0 and gm.buddy("g0").allocated() == [] and gm.held() == {"gpu@g0": {}}
    assert gm.cache("g0").instances() == [] and not gm.cache("g0").busy()
    await runner.close()


async def test_a_node_down_at_start_begins_no_load_and_books_no_miss():
    from tangram.runtime.gpu import GpuRunner

    gm = _manager()
    host = _Host()
    down = asyncio.Event()
    down.set()
    runner = GpuRunner(gm, host, "gpu@g0")
    runner.start_warm(lambda: None, down=lambda: down)
    await asyncio.wait_for(runner._warm, 5)
    st = gm.stats()
    assert host.timeouts == [] and (st["misses"], st["failed_restores"], st["warm_loads"]) == (0, 0, 0)
    await runner.close()


async def test_the_restore_counters_by_source_only_grow():
    """Each source's sum is its own (a request's restore seconds are not a total less the warm ones, which
    rounding could make smaller: Prometheus would read a counter that fell as a reset)."""
    gm = _manager()
    gm.allocate("gpu@g0", 1, "r1", _request("r1", "small", 1))
    gm.restored("gpu@g0", "r1", 0.1)
    gm.release("gpu@g0", "r1")
    before = gm.stats()["nodes"]["gpu@g0"]
    service, chunk = gm.warm_plan("g0")[0]
    gm.warm("g0", "w1", service, chunk)
    gm.restored("g0", "w1", 0.7)
    gm.release("gpu@g0", "w1")
    after = gm.stats()["nodes"]["gpu@g0"]
    assert (after["request_restores"], after["request_restore_s"]) == (before["request_restores"], 0.1) == (1, 0.1)
    assert (after["warm_loads"], after["warm_restore_s"]) == (1, 0.7)
    assert after["restores"] == 2 and after["restore_s"] == pytest.approx(0.8)


@pytest.mark.parametrize("goes_down", [False, True])
async def test_a_scale_out_node_down_before_its_warm_start_loads_nothing(goes_down):
    """The service's build hands each warm start its node's down signal (scale-out)."""
    from tangram.service.build import build_runtime
    from tangram.service.config import parse_config

    cfg = parse_config({"cpu_nodes": [], "scaleout": {"gpu_host": {}},
                        "gpu_nodes": [{"name": "g0", "gpus": 2, "memory_mb_per_gpu": 1000, "warm_start": True,
                                       "services": [{"name": "rm", "state_mb": 10}]}]})
    rt = await build_runtime(cfg)
    try:
        if goes_down:
            rt.node_down("g0", "lost")  # before the warm start's first step
        runner = rt.model_executors["g0"]
        await asyncio.wait_for(runner._warm, 30)
        st = runner.manager.stats()
        if goes_down:
            assert (st["misses"], st["warm_loads"], runner.warm_loads) == (0, 0, 0)
        else:
            # rm at DoP 2, then at DoP 1 on each device: the whole plan, nothing left of it
            assert st["warm_loads"] == runner.warm_loads == 3 and runner.manager.warm_plan("g0") == []
    finally:
        await rt.close()



class _DeadNodeHost(_Host):
    """A host whose node died: its call says so (a Ray actor gone) before any guard does."""

    async def execute(self, decision, payload, *, timeout_s=None):
        from tangram.executors.base import FAILED, ExecResult

        self.timeouts.append(timeout_s)
        return ExecResult(status=FAILED, error="node 'g0' is down: ActorDiedError", node_down=True)


async def test_a_load_that_finds_its_node_dead_ends_the_warm_start():
    from tangram.runtime.gpu import GpuRunner

    gm = _manager()
    host = _DeadNodeHost()
    runner = GpuRunner(gm, host, "gpu@g0")
    runner.start_warm(lambda: None, down=lambda: asyncio.Event())  # the guard has not seen it yet
    await asyncio.wait_for(runner._warm, 5)
    st = gm.stats()
    assert len(host.timeouts) == 1 and (st["misses"], st["failed_restores"], st["warm_loads"]) == (1, 1, 0)
    assert gm.buddy("g0").allocated() == []
    gm.check_invariants()
    await runner.close()


class _DownOnReturnHost(_Host):
    """Loads well, and the node is marked down in the very step its load ends (the health loop's)."""

    def __init__(self, down: asyncio.Event):
        super().__init__()
        self.down = down

    async def execute(self, decision, payload, *, timeout_s=None):
        res = await super().execute(decision, payload, timeout_s=timeout_s)
        self.down.set()
        return res


async def test_a_node_marked_down_as_a_load_ends_begins_no_other_and_counts_that_load():
    from tangram.runtime.gpu import GpuRunner

    gm = _manager()
    down = asyncio.Event()
    host = _DownOnReturnHost(down)
    runner = GpuRunner(gm, host, "gpu@g0")
    runner.start_warm(lambda: None, down=lambda: down)
    await asyncio.wait_for(runner._warm, 5)
    assert len(host.timeouts) == 1  # the plan's first load (all 8 GPUs), and no other
    assert runner.warm_loads == gm.stats()["warm_loads"] == 1 and gm.buddy("g0").allocated() == []
    gm.check_invariants()
    await runner.close()


def test_the_request_restore_seconds_metric_stays_put_when_a_warm_load_comes():
    """The Prometheus series are each source's own sum: a warm load never moves the requests' (a total less
    the warm seconds could fall by a rounding step, which Prometheus reads as a counter reset)."""
    from tangram.service.metrics import _gpu_metrics

    def series(gm):
        return {(f.name, tuple(sorted(s.labels.items()))): s.value for f in _gpu_metrics(gm.stats()) for s in f.samples}

    gm = _manager()
    gm.allocate("gpu@g0", 1, "r1", _request("r1", "small", 1))
    gm.restored("gpu@g0", "r1", 0.1)
    gm.release("gpu@g0", "r1")
    before = series(gm)
    service, chunk = gm.warm_plan("g0")[0]
    gm.warm("g0", "w1", service, chunk)
    gm.restored("g0", "w1", 0.7)
    gm.release("gpu@g0", "w1")
    after = series(gm)
    request = ("tangram_gpu_restore_seconds", (("pool", "gpu@g0"), ("source", "request")))
    warm = ("tangram_gpu_restore_seconds", (("pool", "gpu@g0"), ("source", "warm")))
    assert before[request] == after[request] == 0.1 and (before[warm], after[warm]) == (0.0, 0.7)
    assert all(after[k] >= v for k, v in before.items() if k[0] != "tangram_gpu_warm_loading")
