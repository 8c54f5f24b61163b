"""GPU nodes as Ray actors on a local two-node Ray cluster started here (custom resource
``tangram_gpu`` standing in for GPUs); one Ray node is removed mid-run and added back.
Skips only if ray cannot be imported."""
from __future__ import annotations

import asyncio
import os
import tempfile
import time

import pytest

ray = pytest.importorskip("ray")

from tangram.executors.base import FAILED, SUCCEEDED  # noqa: E402
from tests.helpers import ray_shutdown, stop_ray_and_remove  # noqa: E402
from tangram.scaleout.cluster import ClusterRuntime  # noqa: E402
from tangram.service.build import build_runtime  # noqa: E402
from tangram.service.config import parse_config  # noqa: E402

pytestmark = [pytest.mark.timeout(240)]

NODE_ARGS = {"num_cpus": 1, "resources": {"tangram_gpu": 4}, "object_store_memory": 100_000_000}


@pytest.fixture
def ray_cluster(monkeypatch):
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # the processes of `ray start --head` and `ray start --address` (a node each), and a per-node kill.
    # Everything Ray writes goes under one fresh temp dir, removed afterwards: `Cluster` writes its
    # address file to the *default* Ray dir ($RAY_TMPDIR or $TMPDIR or /tmp, + /ray) whatever
    # `temp_dir` says, and that dir exists only on a machine that ran Ray before. Short path: unix
    # socket paths under it must stay below ~107 characters.
    tmp = tempfile.mkdtemp(prefix="tgr-", dir="/tmp" if len(tempfile.gettempdir()) > 40 else None)
    cluster = None
    try:
        monkeypatch.setenv("RAY_TMPDIR", tmp)
        os.makedirs(os.path.join(tmp, "ray"))
        args = {**NODE_ARGS, "temp_dir": os.path.join(tmp, "ray")}
        cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
        worker = cluster.add_node(**args)
        yield cluster, worker
    finally:
        stop_ray_and_remove(tmp, ray_shutdown(cluster))


async def _until(pred, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.1)


def model(rt, gpus: int, exec_s: float, inputs=(1, 2)):
    return rt.build_action("model", {"gpu": gpus}, payload={"model": "rm", "inputs": list(inputs), "exec_s": exec_s})


async def test_ray_gpu_nodes_as_actors_node_removed_and_added_back(ray_cluster):
    cluster, worker = ray_cluster
    cfg = parse_config({
        "cpu_nodes": [],
        "gpu_nodes": [{"name": n, "gpus": 4, "memory_mb_per_gpu": 1000,
                       "services": [{"name": "rm", "state_mb": 600}]} for n in ("g0", "g1")],
        "scaleout": {"health": {"interval_s": 0.3, "timeout_s": 2.0, "failures": 1},
                     "gpu_host": {"address": cluster.address, "resource": "tangram_gpu",
                                  "simulated": {"restore_gbps": 50.0}}},
    })
    rt = await build_runtime(cfg)
    assert isinstance(rt, ClusterRuntime)
    try:
        hosts = {n: await asyncio.wait_for(rt.model_executors[n].inner.host.handle.call("ping"), 60) for n in ("g0", "g1")}
        # Ray placed one actor per Ray node (each needs all 4 `tangram_gpu` of a node)
        assert len({h["where"] for h in hosts.values()}) == 2
        on_worker = next(n for n, h in hosts.items() if h["where"] == worker.node_id)
        other = "g1" if on_worker == "g0" else "g0"
        # both nodes serve; the second action on a node hits the service its actor restored
        outs = await asyncio.gather(rt.run(model(rt, 4, 0.01)), rt.run(model(rt, 4, 0.01)))
        assert sorted(o.allocation["node"] for o in outs) == ["g0", "g1"], outs
        assert all(o.status == SUCCEEDED and o.output["restored"] for o in outs)
        again = await rt.run(model(rt, 4, 0.01))
        assert again.output["hit"] and again.output["where"] == hosts[again.allocation["node"]]["where"]
        # two long actions, one per node; then the worker Ray node dies
        longs = [rt.submit(model(rt, 4, 60.0)) for _ in range(2)]
        await _until(lambda: all(a in rt.engine.running for a in longs), 10)
        doomed = next(a for a in longs if rt.engine.running[a].dispatch.node == on_worker)
        cluster.remove_node(worker)
        o = await asyncio.wait_for(rt.wait(doomed), 30)
        assert o.status == FAILED and f"node {on_worker!r} is down" in o.error, o
        assert on_worker in rt.down
        assert not any(p.node == on_worker for p in rt.engine.pool_states().values())
        survivor = next(a for a in longs if a != doomed)
        assert rt.cancel(survivor)
        assert (await rt.wait(survivor)).status != FAILED
        ok = await rt.run(model(rt, 2, 0.01))  # the rest of the cluster keeps serving
        assert ok.status == SUCCEEDED and ok.allocation["node"] == other
        rt.engine.check_invariants()
        # a Ray node with the resources joins again: Ray restarts the actor there, the node is back
        cluster.add_node(**NODE_ARGS)
        await _until(lambda: on_worker not in rt.down, 90)
        pools = rt.engine.pool_states()
        assert pools[f"gpu@{on_worker}"].free == 4
        both = await asyncio.gather(rt.run(model(rt, 4, 0.01)), rt.run(model(rt, 4, 0.01)))
        assert all(b.status == SUCCEEDED for b in both), both
        back = next(b for b in both if b.allocation["node"] == on_worker)
        # the books still listed the service there; the fresh actor restored it (self-healing hit)
        assert back.output["restored"] or back.output["healed"]
        rt.engine.check_invariants()
    finally:
        await rt.close()
    rt.check_whole()


async def test_ray_gpu_hosts_run_a_torch_module(ray_cluster):
    pytest.importorskip("torch")
    from tests.scaleout_models import reference

    cluster, _ = ray_cluster
    cfg = parse_config({
        "cpu_nodes": [],
        "gpu_nodes": [{"name": n, "gpus": 4, "memory_mb_per_gpu": 1000,
                       "services": [{"name": "tiny", "state_mb": 1,
                                     "options": {"factory": "tests.scaleout_models:TinyScorer"}}]}
                      for n in ("g0", "g1")],
        "scaleout": {"gpu_host": {"address": cluster.address, "resource": "tangram_gpu", "executor": "torch"}},
    })
    rt = await build_runtime(cfg)
    xs = [[float(i), 0.5, -1.0] for i in range(6)]
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(rt.run(rt.build_action(
            "model", {"gpu": 4}, payload={"model": "tiny", "op": "score", "inputs": xs})) for _ in range(2))), 90)
        assert all(o.status == SUCCEEDED for o in outs), [o.error for o in outs]
        assert sorted(o.allocation["node"] for o in outs) == ["g0", "g1"]
        for o in outs:  # computed inside each node's actor, by the module its factory built there
            assert o.output == pytest.approx(reference(xs), abs=1e-6)
    finally:
        await rt.close()
    rt.check_whole()
