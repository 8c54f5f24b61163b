"""Scale-out without real engines: node gates, the cluster runtime's node down/up, the health loop,
Docker topology parsing and client settings, the in-process GPU host. Fast (fake executors)."""
from __future__ import annotations

import asyncio
import re
from typing import Mapping

import pytest

from tangram.core.engine import Engine
from tangram.core.errors import DemandError
from tangram.core.model import Action
from tangram.executors.base import FAILED, SUCCEEDED, EnvironmentExecutor, ExecResult, Placement
from tangram.managers.cpu import CpuManager, CpuNode
from tangram.scaleout.cluster import ClusterRuntime, EnvironmentLostError
from tangram.scaleout.docker_nodes import DockerTls, client_kwargs, parse_probe, topology
from tangram.scaleout.gate import DownNodes, gate_all
from tangram.scaleout.health import HealthMonitor
from tangram.scaleout.ray_gpu import GpuHostConfig, GpuHosts, build_remote_gpu
from tangram.service.build import build_runtime
from tangram.service.config import parse_config


class SleepExecutor(EnvironmentExecutor):
    """``sleep X`` sleeps X seconds (cancellable); ``fail`` fails; records where things ran."""

    name = "fake"

    def __init__(self, node: str):
        self.node = node
        self.envs: set[str] = set()
        self.ran: list[tuple[str, tuple[int, ...]]] = []

    async def create_environment(self, env_id: str, **kw) -> None:
        self.envs.add(env_id)

    async def destroy_environment(self, env_id: str) -> None:
        self.envs.discard(env_id)

    async def exec(self, env_id: str, command: str, placement: Placement, *, timeout_s=None,
                   env: Mapping[str, str] | None = None) -> ExecResult:
        assert env_id in self.envs, f"{env_id} not created on {self.node}"
        self.ran.append((env_id, tuple(placement.cores)))
        m = re.match(r"sleep ([\d.]+)", command)
        if m:
            await asyncio.sleep(float(m.group(1)))
        return ExecResult(status=SUCCEEDED, exit_code=0, stdout=self.node)


def two_nodes() -> list[CpuNode]:
    return [CpuNode("a", cores=(0, 1, 2, 3), memory_mb=1000), CpuNode("b", cores=(0, 1, 2, 3), memory_mb=1000)]


def make_cluster(down: DownNodes | None = None, gpu: bool = False, executor: type = SleepExecutor):
    down = down or DownNodes()
    managers = [CpuManager(two_nodes())]
    model_executors = models = None
    if gpu:
        from tangram.service.config import GpuNodeConfig, GpuServiceConfig

        nodes = [GpuNodeConfig(name=n, gpus=(0, 1, 2, 3), memory_mb_per_gpu=1000,
                               services=(GpuServiceConfig(name="rm", state_mb=600),)) for n in ("g0", "g1")]
        gm, model_executors, models = build_remote_gpu(nodes, GpuHosts(GpuHostConfig(sim={"restore_gbps": 50.0})))
        managers.append(gm)
    ex = {"a": executor("a"), "b": executor("b")}
    eng = Engine(gate_all(managers, down))
    return ClusterRuntime(eng, down=down, env_executors=ex, model_executors=model_executors, models=models,
                          grace_s=0.5), ex


# --------------------------------------------------------------------------- #
# the engine pins a trajectory to its node; gates hide a down node's pools


def test_engine_pins_trajectory_to_its_node_each_node_scheduled_independently():
    eng = Engine(gate_all([CpuManager(two_nodes())], DownNodes()))
    first = eng.submit(Action.build("t1-0", {"cpu": 1}, trajectory="t1", mem_mb=600))
    node = first[0].dispatch.node
    other = "b" if node == "a" else "a"
    # t2's memory does not fit beside t1's: memory-load balancing sends it to the other node
    second = eng.submit(Action.build("t2-0", {"cpu": 1}, trajectory="t2", mem_mb=600))
    assert second[0].dispatch.node == other
    # fill t1's node: t1's next actions wait for it rather than moving to the free node
    eng.submit(Action.build("x", {"cpu": 3}, trajectory="t1"))
    assert eng.running["x"].dispatch.node == node
    assert eng.submit(Action.build("t1-1", {"cpu": 1}, trajectory="t1")) == []
    assert eng.pool_states()[f"cpu@{other}"].free == 3  # free elsewhere, yet t1-1 waits
    started = eng.complete("t1-0")
    assert [(s.action.id, s.dispatch.node) for s in started] == [("t1-1", node)]
    eng.check_invariants()


def test_gate_hides_down_pools_and_keeps_books_balanced():
    down = DownNodes()
    eng = Engine(gate_all([CpuManager(two_nodes())], down))
    eng.submit(Action.build("t1-0", {"cpu": 2}, trajectory="t1", mem_mb=100))
    node = eng.running["t1-0"].dispatch.node
    down.mark_down(node, "test")
    assert {p.node for p in eng.pool_states().values()} == {"b" if node == "a" else "a"}
    eng.check_invariants()  # the grant on the hidden node is still in the books
    eng.complete("t1-0", FAILED)
    eng.close_trajectory("t1")
    eng.check_invariants()
    # demands only a down node could serve are refused at submit, not queued forever
    down.mark_down("b" if node == "a" else "a")
    with pytest.raises(DemandError):
        eng.submit(Action.build("y", {"cpu": 1}))
    down.mark_up("a")
    down.mark_up("b")
    assert all(p.free == p.capacity for p in eng.pool_states().values())


# --------------------------------------------------------------------------- #
# the cluster runtime: node down / up


async def test_node_down_fails_its_work_rejects_its_environments_and_the_rest_keeps_serving():
    rt, ex = make_cluster()
    async with rt:
        e1 = await rt.create_environment(memory_mb=600, env_id="e1")
        e2 = await rt.create_environment(memory_mb=600, env_id="e2")
        r1 = rt.submit(rt.build_action("exec", {"cpu": 4}, environment=e1, command="sleep 5"))
        r2 = rt.submit(rt.build_action("exec", {"cpu": 4}, environment=e2, command="sleep 0.3"))
        q1 = rt.submit(rt.build_action("exec", {"cpu": 1}, environment=e1, command="true"))  # queued behind r1
        await asyncio.sleep(0.05)
        dead = rt.engine.placement[e1]
        alive = rt.engine.placement[e2]
        assert dead != alive
        assert rt.node_down(dead, "probe failed")
        assert not rt.node_down(dead)  # idempotent
        o1, oq = await asyncio.wait_for(asyncio.gather(rt.wait(r1), rt.wait(q1)), 3)
        for o in (o1, oq):
            assert o.status == FAILED and f"node {dead!r} is down: probe failed" in o.error, o
        assert (await rt.wait(r2)).status == SUCCEEDED  # the other node keeps serving
        with pytest.raises(EnvironmentLostError) as err:
            rt.submit(rt.build_action("exec", {"cpu": 1}, environment=e1, command="true"))
        assert err.value.field == "environment" and dead in err.value.reason
        assert isinstance(err.value, DemandError)
        pools = rt.engine.pool_states()
        assert all(p.node != dead for p in pools.values())
        assert pools[f"mem@{alive}"].free == 400
        rt.engine.check_invariants()
        # a new environment lands on the live node
        e3 = await rt.create_environment(memory_mb=100, env_id="e3")
        assert (await rt.exec(e3, "true")).stdout == alive
        assert rt.stats()["nodes_down"] == {dead: "probe failed"}
        # deleting the lost environment works while its node is down (cleaned once it is back)
        await rt.delete_environment(e1)
        assert e1 in ex[dead].envs
        # the node returns: its pools are back whole, leftovers removed, it takes new work
        assert rt.node_up(dead)
        await asyncio.sleep(0.05)
        assert e1 not in ex[dead].envs
        pools = rt.engine.pool_states()
        assert pools[f"cpu@{dead}"].free == 4 and pools[f"mem@{dead}"].free == 1000
        e4 = await rt.create_environment(memory_mb=900, env_id="e4")  # only fits on the returned node
        assert (await rt.exec(e4, "true")).stdout == dead
        rt.engine.check_invariants()
    rt.check_whole()


async def test_gpu_node_down_through_in_process_hosts():
    rt, _ = make_cluster(gpu=True)
    async with rt:
        a = rt.build_action("model", {"gpu": 2}, payload={"model": "rm", "inputs": [1, 2, 3], "exec_s": 0.01})
        o = await rt.run(a)
        assert o.status == SUCCEEDED and o.output["restored"] and not o.output["hit"], o
        node = o.allocation["node"]
        again = await rt.run(rt.build_action("model", {"gpu": 2}, payload={"model": "rm", "exec_s": 0.01}))
        assert again.output["hit"], "the second call hits the resident service"
        long = rt.submit(rt.build_action("model", {"gpu": 4}, payload={"model": "rm", "exec_s": 5.0}))
        await asyncio.sleep(0.05)
        where = rt.engine.running[long].dispatch.node
        rt.node_down(where, "actor died")
        o = await asyncio.wait_for(rt.wait(long), 3)
        assert o.status == FAILED and f"node {where!r} is down" in o.error
        assert all(p.node != where for p in rt.engine.pool_states().values())
        other = await rt.run(rt.build_action("model", {"gpu": 4}, payload={"model": "rm", "exec_s": 0.01}))
        assert other.status == SUCCEEDED and other.allocation["node"] != where
        rt.node_up(where)
        rt.engine.check_invariants()
        assert node
    rt.check_whole()


async def test_gpu_hosts_in_process_without_a_cluster():
    cfg = parse_config({
        "cpu_nodes": [],
        "gpu_nodes": [{"name": "g0", "gpus": 2, "memory_mb_per_gpu": 1000, "services": [{"name": "rm", "state_mb": 10}]}],
        "scaleout": {"gpu_host": {}},
    })
    rt = await build_runtime(cfg)
    try:
        o = await rt.run(rt.build_action("model", {"gpu": 1}, payload={"model": "rm", "exec_s": 0.0}))
        assert o.status == SUCCEEDED and o.output["where"] == "local"
    finally:
        await rt.close()
    rt.check_whole()


async def test_gpu_host_in_process_runs_a_torch_module_by_its_factory():
    pytest.importorskip("torch")
    from tests.scaleout_models import reference

    cfg = parse_config({
        "cpu_nodes": [],
        "gpu_nodes": [{"name": "g0", "gpus": 2, "memory_mb_per_gpu": 1000,
                       "services": [{"name": "tiny", "state_mb": 1,
                                     "options": {"factory": "tests.scaleout_models:TinyScorer"}}]}],
        "scaleout": {"gpu_host": {"executor": "torch"}},
    })
    rt = await build_runtime(cfg)
    xs = [[float(i), 1.0, -1.0] for i in range(5)]
    try:
        first = await rt.run(rt.build_action("model", {"gpu": 2}, payload={"model": "tiny", "op": "score", "inputs": xs}))
        assert first.status == SUCCEEDED, first.error
        assert first.output == pytest.approx(reference(xs), abs=1e-6)
        again = await rt.run(rt.build_action("model", {"gpu": 2}, payload={"model": "tiny", "op": "score", "inputs": xs}))
        assert again.output == first.output
        assert rt.engine.managers[0].stats()["hits"] == 1  # the second call hit the restored service
    finally:
        await rt.close()
    rt.check_whole()


def test_scaleout_imports_neither_ray_nor_docker_until_used():
    import subprocess
    import sys

    code = ("import asyncio, sys\n"
            "from tangram.service.build import build_runtime\n"
            "from tangram.service.config import parse_config\n"
            "cfg = parse_config({'cpu_nodes': [], 'gpu_nodes': [{'name': 'g', 'gpus': 1, 'memory_mb_per_gpu': 10}],"
            " 'scaleout': {'gpu_host': {}}})\n"
            "async def main():\n"
            "    rt = await build_runtime(cfg)\n"
            "    await rt.close()\n"
            "asyncio.run(main())\n"
            "print(sorted(m for m in ('ray', 'docker', 'torch') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


async def test_broken_call_and_failed_probe_mark_the_node_down_at_once_and_the_loop_brings_it_back():
    rt, ex = make_cluster()
    alive = {"a": True, "b": True}

    def probe(n):
        async def p():
            if not alive[n]:
                raise ConnectionRefusedError("engine gone")
        return p

    async def broken(*a, **kw):
        raise ConnectionResetError("stream closed")

    async with rt:
        rt.start_health({"a": probe("a"), "b": probe("b")}, interval_s=0.05, timeout_s=0.5, failures=5)
        env = await rt.create_environment(env_id="eb")
        assert (await rt.exec(env, "true")).status == SUCCEEDED
        node = rt.engine.placement[env]
        alive[node] = False
        ex[node].exec = broken
        o = await rt.run(rt.build_action("exec", {"cpu": 1}, environment=env, command="true"))
        # one broken call plus one failed ping: down now, not after `failures` rounds
        assert o.status == FAILED and f"node {node!r} is down: ConnectionRefusedError" in o.error, o
        assert node in rt.down
        alive[node] = True
        for _ in range(100):
            if node not in rt.down:
                break
            await asyncio.sleep(0.02)
        assert node not in rt.down
        # marked down by hand (maintenance): the loop puts it back once it answers
        rt.node_down(node, "maintenance")
        for _ in range(100):
            if node not in rt.down:
                break
            await asyncio.sleep(0.02)
        assert node not in rt.down
        rt.engine.check_invariants()


# --------------------------------------------------------------------------- #
# health loop


async def test_health_monitor_marks_down_after_consecutive_failures_and_up_on_return():
    state = {"x": True, "y": True}
    events: list[tuple[str, str]] = []

    def probe(n):
        async def p():
            if state[n] is None:
                await asyncio.sleep(10)  # hangs: the timeout decides
            if not state[n]:
                raise ConnectionError("refused")
        return p

    mon = HealthMonitor({"x": probe("x"), "y": probe("y")}, on_down=lambda n, why: events.append(("down", n)),
                        on_up=lambda n: events.append(("up", n)), timeout_s=0.05, failures=2)
    assert await mon.check_once() == {"x": None, "y": None}
    state["x"], state["y"] = False, None
    v = await mon.check_once()
    assert "refused" in v["x"] and "no answer" in v["y"] and events == []  # one miss is not a dead node
    await mon.check_once()
    assert sorted(events) == [("down", "x"), ("down", "y")]
    await mon.check_once()
    assert len(events) == 2  # reported once
    state["x"] = True
    await mon.check_once()
    assert events[-1] == ("up", "x") and mon.down == {"y"}
    await mon.close()


# --------------------------------------------------------------------------- #
# Docker endpoints: topology and client settings (no engine needed)


def test_docker_topology_from_info_and_probe_config_wins():
    out = "cpus 0-3,8-11\nnuma 0 0-7\nnuma 1 8-15\n"
    assert parse_probe(out) == ([0, 1, 2, 3, 8, 9, 10, 11], [list(range(8)), list(range(8, 16))])
    node = topology("n1", 16, 64 << 30, out)
    assert node.cores == (0, 1, 2, 3, 8, 9, 10, 11)
    assert node.numa == ((0, 1, 2, 3), (8, 9, 10, 11)) and node.memory_mb == 65536
    # no probe output: NCPU cores, one domain; configured values win
    assert topology("n2", 4, 1 << 30, None).cores == (0, 1, 2, 3)
    n3 = topology("n3", 16, 64 << 30, out, cores=[0, 1, 8], memory_mb=1000)
    assert n3.cores == (0, 1, 8) and n3.numa == ((0, 1), (8,)) and n3.memory_mb == 1000


def test_docker_client_kwargs_for_unix_tcp_tls_and_ssh():
    assert client_kwargs("unix:///tmp/d.sock")["base_url"] == "unix:///tmp/d.sock"
    tls = DockerTls.from_mapping({"ca_cert": "/c/ca.pem", "client_cert": "/c/cert.pem", "client_key": "/c/key.pem"})
    assert client_kwargs("tcp://h:2376", tls=tls)["tls"] is tls
    assert client_kwargs("ssh://u@h")["use_ssh_client"] is True
    with pytest.raises(ValueError):
        client_kwargs("unix:///x", tls=tls)
    with pytest.raises(ValueError):
        DockerTls.from_mapping({"client_cert": "/c/cert.pem"})
    with pytest.raises(ValueError):
        client_kwargs("localhost")


# --------------------------------------------------------------------------- #
# through the wire: the service reports a lost environment and the nodes down


async def test_service_reports_lost_environment_and_nodes_down_over_http(tmp_path):
    from tangram.client import TangramHTTPError
    from tests.service_helpers import N_CORES, config, running_service

    cfg = config(cpu_nodes=[{"name": "here", "executor": "local", "cores": N_CORES, "memory_mb": 1024,
                             "workdir": str(tmp_path)}],
                 scaleout={"health": {"interval_s": 5.0}})  # no probes for a local node: down only by hand
    async with running_service(cfg) as svc, svc.client() as c:
        rt = svc.runtime
        assert isinstance(rt, ClusterRuntime)
        env = await c.create_environment(memory_mb=128)
        assert (await c.exec(env, "echo ok")).stdout == "ok\n"
        rt.node_down("here", "maintenance")
        with pytest.raises(TangramHTTPError) as err:
            await c.exec(env, "echo again")
        assert err.value.status == 422 and err.value.field == "environment"
        assert "node 'here'" in err.value.message and "maintenance" in err.value.message
        with pytest.raises(TangramHTTPError) as err:
            await c.exec(None, "true")  # no live node has cores: refused at once, and why
        assert err.value.status == 422 and "nodes down now: ['here']" in err.value.message
        stats = await c.stats()
        assert stats["nodes_down"] == {"here": "maintenance"} and not any(
            p["node"] == "here" for p in stats["pools"].values())
        await c.delete_environment(env)
        rt.node_up("here")
        assert (await c.exec(None, "echo back")).stdout == "back\n"
        rt.check_whole()


async def test_cancel_while_the_node_dies_never_waits_on_the_dead_node_past_the_grace():
    from tangram.scaleout.cluster import NodeGuard, NodeSignals

    down = DownNodes()
    signals = NodeSignals(down)
    guard = NodeGuard("n", signals, grace_s=0.2)

    async def stubborn():  # an executor whose kill hangs on a dead engine
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(30)
            raise

    call = asyncio.ensure_future(guard.race(stubborn))
    await asyncio.sleep(0.05)
    call.cancel()
    await asyncio.sleep(0.05)
    assert not call.done()  # a live node: the kill is awaited
    down.mark_down("n", "gone")
    signals.set_down("n")
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert asyncio.get_running_loop().time() - t0 < 1.0


@pytest.mark.parametrize("where", ["second host", "runtime"])
async def test_a_scaleout_build_that_fails_part_way_kills_the_gpu_hosts_it_had_started(monkeypatch, where):
    """A build failing while it starts its GPU hosts (the second node's), or after (its runtime), kills the
    hosts already started and forgets them: a failed start leaves no actor behind."""
    from tangram.scaleout import build as scaleout_build
    from tangram.scaleout import ray_gpu

    killed: list[str] = []
    started: list[GpuHosts] = []
    start = GpuHosts.start

    def failing_start(self, node, *args, **kw):
        started.append(self)
        if where == "second host" and node == "g1":
            raise RuntimeError("the host of g1 did not start")
        return start(self, node, *args, **kw)

    def failing_runtime(self, *args, **kw):
        raise RuntimeError("the runtime did not start")

    monkeypatch.setattr(GpuHosts, "start", failing_start)
    monkeypatch.setattr(ray_gpu.LocalHandle, "kill", lambda self: killed.append(self.host.node))
    if where == "runtime":
        monkeypatch.setattr(scaleout_build.Scaleout, "runtime", failing_runtime)
    node = {"gpus": 2, "memory_mb_per_gpu": 1000, "services": [{"name": "rm", "state_mb": 10}]}
    cfg = parse_config({"cpu_nodes": [], "gpu_nodes": [{"name": "g0", **node}, {"name": "g1", **node}],
                        "scaleout": {"gpu_host": {}}})
    with pytest.raises(RuntimeError, match="did not start"):
        await build_runtime(cfg)
    assert started and all(h is started[0] for h in started)
    assert killed == (["g0"] if where == "second host" else ["g0", "g1"])
    assert started[0].handles == {}
