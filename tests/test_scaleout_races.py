"""Scale-out races and untrusted remote answers (fake executors and hosts, no engine needed):
stale reattaches and stale health answers, hung pings, returning nodes' cleanup, bogus topology."""
from __future__ import annotations

import asyncio
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from tangram.core.errors import UnavailableError
from tangram.executors.base import SUCCEEDED
from tangram.scaleout.cluster import EnvironmentLostError
from tangram.scaleout.health import HealthMonitor
from tests.service_helpers import until
from tests.test_scaleout import SleepExecutor, make_cluster


class KeepingExecutor(SleepExecutor):
    """Environments that outlive an outage (as Docker's containers do); reattaches wait at ``gate``."""

    outlives_outages = True

    def __init__(self, node: str):
        super().__init__(node)
        self.gate = asyncio.Event()
        self.gate.set()
        self.reattached: list[str] = []

    async def reattach_environment(self, env_id: str) -> bool:
        await self.gate.wait()
        self.reattached.append(env_id)
        return env_id in self.envs


async def placed(rt, env_id: str) -> str:
    env = await rt.create_environment(memory_mb=100, env_id=env_id)
    assert (await rt.exec(env, "true")).status == SUCCEEDED
    return rt.engine.placement[env]


def noop(*_a) -> None:
    pass


# --------------------------------------------------------------------------- #
# node down / up while a reattach or a health round is under way


async def test_a_reattach_of_an_earlier_outage_never_ends_a_newer_suspension():
    rt, ex = make_cluster(executor=KeepingExecutor)
    async with rt:
        node = await placed(rt, "e")
        ex[node].gate.clear()
        rt.node_down(node, "first")
        rt.node_up(node)
        await asyncio.sleep(0.05)  # its reattach is under way, held at the gate
        rt.node_down(node, "second")
        ex[node].gate.set()
        await asyncio.sleep(0.05)  # the first reattach answers "ok": for the first outage only
        assert "e" in rt.suspended
        with pytest.raises(UnavailableError):  # 503 + Retry-After, not "lost"
            rt.submit(rt.build_action("exec", {"cpu": 1}, environment="e", command="true"))
        rt.node_up(node)  # this return reattaches it
        await until(lambda: "e" not in rt.suspended)
        assert (await rt.exec("e", "true")).status == SUCCEEDED
        rt.engine.check_invariants()


async def test_a_health_round_under_way_never_brings_back_a_node_marked_down_meanwhile():
    rt, _ = make_cluster()
    alive = {"a": True}

    async def ping_a():
        if not alive["a"]:
            raise ConnectionRefusedError("engine gone")

    async def ping_b():
        await asyncio.sleep(0.3)  # a slow node keeps the round open

    async with rt:
        rt.start_health({"a": ping_a, "b": ping_b}, interval_s=60.0, timeout_s=1.0, failures=3)
        await asyncio.sleep(0.1)  # the round began: `a` answered, `b` is still being asked
        alive["a"] = False
        assert await rt.env_executors["a"].guard.suspect() is not None  # a broken call and a failed ping
        assert "a" in rt.down
        await asyncio.sleep(0.4)  # the round ends with a's answer from before it went down
        assert "a" in rt.down


# --------------------------------------------------------------------------- #
# hung pings


async def test_a_ping_hung_past_its_abandon_time_is_left_and_a_fresh_one_sees_the_daemon_back():
    """Joined for ever, a ping that never returns would keep a recovered daemon's node down."""
    from tangram.scaleout.docker_nodes import DockerPing

    hang = threading.Event()
    p = DockerPing("unix:///nowhere", timeout_s=0.05)
    p.abandon_after_s = 0.2
    p._ping = lambda: hang.wait(10)
    mon = HealthMonitor({"n": p}, on_down=noop, on_up=noop, timeout_s=0.05, failures=1)
    try:
        assert "no answer" in (await mon.check_once())["n"]
        p._ping = lambda: None  # the daemon is back; the first ping still hangs
        assert "no answer" in (await mon.check_once())["n"]  # joined: not yet abandoned
        await asyncio.sleep(0.25)
        assert (await mon.check_once())["n"] is None  # abandoned: a fresh ping answers
    finally:
        hang.set()


async def test_a_hung_docker_ping_is_joined_not_repeated_and_never_needs_the_loops_pool():
    from tangram.scaleout.docker_nodes import DockerPing

    calls: list[int] = []
    hang = threading.Event()

    def stuck() -> None:  # an ssh:// ping: no read timeout
        calls.append(1)
        hang.wait(10)

    p = DockerPing("unix:///nowhere", timeout_s=0.05)
    p._ping = stuck
    mon = HealthMonitor({"n": p}, on_down=noop, on_up=noop, timeout_s=0.05, failures=1)
    try:
        for _ in range(3):
            assert "no answer" in (await mon.check_once())["n"]
        assert len(calls) == 1  # no new thread per round
    finally:
        hang.set()
    await until(lambda: p._inflight.done())
    # the loop's default pool is full (as pings left hanging in it used to make it): pings still run
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    block = threading.Event()
    loop.run_in_executor(None, block.wait, 10)
    try:
        p._ping = lambda: calls.append(2)
        assert (await mon.check_once())["n"] is None and calls == [1, 2]
    finally:
        block.set()


async def test_a_hung_ray_host_delays_a_health_round_by_timeout_s_only(monkeypatch):
    from tangram.scaleout import ray_gpu

    class HungRef:  # the ObjectRef of a host that never answers, not even to a cancel
        def __init__(self):
            self.fut = asyncio.get_running_loop().create_future()

        def __await__(self):
            return asyncio.shield(self.fut).__await__()

    method = types.SimpleNamespace(remote=lambda *a: HungRef())
    actor = types.SimpleNamespace(ping=method, execute=method)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(cancel=noop))
    monkeypatch.setattr(ray_gpu, "_CANCEL_SETTLE_S", 3.0)
    mon = HealthMonitor({"g": ray_gpu.RayHandle(actor, "tangram-gpu-g").ping}, on_down=noop, on_up=noop,
                        timeout_s=0.1, failures=1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert "no answer" in (await mon.check_once())["g"]
    assert loop.time() - t0 < 1.0


# --------------------------------------------------------------------------- #
# a returning node: cleaned before it takes work; what is lost gets removed there


async def test_a_returning_node_takes_no_work_until_its_leftovers_are_removed():
    rt, ex = make_cluster()
    async with rt:
        node = await placed(rt, "e")
        other = "b" if node == "a" else "a"
        rt.node_down(node, "gone")
        await rt.delete_environment("e")  # removed from the node once it is back
        gate = asyncio.Event()
        remove = ex[node].destroy_environment

        async def slow_remove(env_id: str) -> None:
            await gate.wait()
            await remove(env_id)

        ex[node].destroy_environment = slow_remove
        busy = rt.submit(rt.build_action("exec", {"cpu": 4}, command="sleep 5"))
        await until(lambda: busy in rt.engine.running)
        assert rt.engine.running[busy].dispatch.node == other
        waiting = rt.submit(rt.build_action("exec", {"cpu": 4}, command="true"))
        rt.node_up(node)
        await asyncio.sleep(0.05)
        assert rt.engine.pool_states()[f"cpu@{node}"].free == 0 and waiting in rt.engine.waiting
        gate.set()
        o = await asyncio.wait_for(rt.wait(waiting), 2)  # placed once the cleanup is done
        assert o.status == SUCCEEDED and o.allocation["node"] == node and "e" not in ex[node].envs
        rt.cancel(busy)
        await rt.wait(busy)
    rt.check_whole()


async def test_a_failed_orphan_removal_is_tried_again_when_the_node_next_returns():
    rt, ex = make_cluster()
    async with rt:
        node = await placed(rt, "e")
        rt.node_down(node, "gone")
        await rt.delete_environment("e")
        fails = [ConnectionResetError("engine still starting")]
        remove = ex[node].destroy_environment

        async def flaky_remove(env_id: str) -> None:
            if fails:
                raise fails.pop()
            await remove(env_id)

        ex[node].destroy_environment = flaky_remove
        rt.node_up(node)
        await until(lambda: rt.engine.pool_states()[f"cpu@{node}"].free == 4)  # a failure does not keep it held
        assert "e" in ex[node].envs and "e" in rt.env_executors[node].orphans
        rt.node_down(node, "again")
        rt.node_up(node)
        await until(lambda: "e" not in ex[node].envs)
    rt.check_whole()


async def test_an_environment_given_up_while_its_node_is_down_is_removed_when_it_returns():
    rt, ex = make_cluster(executor=KeepingExecutor)
    async with rt:
        node = await placed(rt, "e")
        rt.node_down(node, "gone")
        assert "e" in rt.suspended
        rt.give_up_s = 0.0
        with pytest.raises(EnvironmentLostError):
            rt.submit(rt.build_action("exec", {"cpu": 1}, environment="e", command="true"))
        rt.node_up(node)
        await until(lambda: "e" not in ex[node].envs)
        assert ex[node].reattached == []
        await rt.delete_environment("e")  # nothing left to remove: still fine
    rt.check_whole()


# --------------------------------------------------------------------------- #
# topology discovery does not trust the engine's numbers


def test_docker_topology_refuses_bogus_core_and_memory_reports_naming_the_node():
    from tangram.scaleout.docker_nodes import NotOnEngine, topology

    for ncpu, probe in ((4, "cpus 0-99999\n"), (4, "cpus 0-3\nnuma 0 0-99999\n"), (100_000, None), (0, None),
                        (4, "cpus 0-999999999\n"), (10 ** 9, None)):
        with pytest.raises(NotOnEngine) as err:
            topology("n1", ncpu, 1 << 30, probe)
        assert err.value.field == "cores" and "'n1'" in str(err.value)
    with pytest.raises(NotOnEngine) as err:
        topology("n1", 4, 0, None)
    assert err.value.field == "memory_mb" and "'n1'" in str(err.value)
    assert topology("n1", 4, 0, None, memory_mb=512).memory_mb == 512  # the config can say it
    assert topology("n1", 0, 1 << 30, None, cores=[0, 1]).cores == (0, 1)  # and the cores
    assert topology("n1", 4096, 1 << 30, "cpus 0-4095\n").cores == tuple(range(4096))


class _ProbeContainer:
    id = "probe1"

    def __init__(self, hangs: bool):
        self.hangs = hangs
        self.waited: float | None = None
        self.removed = False

    def wait(self, timeout=None):
        self.waited = timeout
        if self.hangs:
            raise TimeoutError("read timed out")
        return {"StatusCode": 0}

    def logs(self, **kw):
        return b"cpus 0-1\n"

    def remove(self, force=False):
        self.removed = True


class _ProbeClient:
    def __init__(self, hangs: bool):
        self.container = _ProbeContainer(hangs)
        self.run_kw: dict = {}
        self.containers = self

    def info(self):
        return {"NCPU": 4, "MemTotal": 1 << 30}

    def run(self, **kw):
        self.run_kw = kw
        if not kw.get("detach"):
            raise AssertionError("an attached run waits with no timeout")
        return self.container


def test_docker_topology_probe_runs_detached_with_a_deadline_and_is_always_removed():
    from tangram.scaleout import docker_nodes

    for hangs, cores in ((False, (0, 1)), (True, (0, 1, 2, 3))):  # a stuck probe: docker info only
        client = _ProbeClient(hangs)
        node = docker_nodes.discover(client, "n1", image="custom:probe")
        assert node.cores == cores and client.run_kw["detach"] is True
        assert client.container.waited == docker_nodes.PROBE_TIMEOUT_S and client.container.removed


async def test_a_networked_environment_goes_to_the_guarded_node_that_allows_a_network():
    """Scale-out wraps each node's executor: the runtime reads allow_network through the wrapper (it read
    none, and every networked environment was refused as if no node gave a network)."""
    class Networked(SleepExecutor):
        @property
        def allow_network(self) -> bool:
            return self.node == "b"

    rt, ex = make_cluster(executor=Networked)
    env = await rt.create_environment(memory_mb=100, network=True)
    assert env in ex["b"].envs and env not in ex["a"].envs
    await rt.close()


async def test_an_api_call_naming_a_trajectory_on_a_down_node_is_not_held_by_it():
    """An http action only names its trajectory: the environment lost with its node (these executors'
    environments do not outlive an outage) does not refuse it, as it refuses the environment's commands."""
    from tangram.core.model import Action, Demand

    rt, ex = make_cluster()
    env = await rt.create_environment(memory_mb=100)
    await rt.run(rt.build_action("exec", {"cpu": 1}, environment=env, command="sleep 0"))
    node = next(n for n, e in ex.items() if env in e.envs)
    rt.node_down(node, "test")
    a = Action.build("call-1", {"cpu": Demand.fixed(1)}, trajectory=env, payload={"kind": "http"})
    assert env in rt.lost
    with pytest.raises(EnvironmentLostError):
        rt.submit(rt.build_action("exec", {"cpu": 1}, environment=env, command="sleep 0"))
    assert rt.submit(a) == "call-1"  # not EnvironmentLostError: it does not run in the environment
    await rt.close()
