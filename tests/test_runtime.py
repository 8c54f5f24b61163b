"""The Runtime in-process (no HTTP): the API the demo, profiling and verl integration use."""
from __future__ import annotations

import asyncio
import os

import pytest

from tangram.core.engine import Engine
from tangram.core.errors import DemandError, UnschedulableError
from tangram.executors.base import EnvironmentExecutor, ExecResult, wait_through_cancels
from tangram.managers.base import CountingManager
from tangram.managers.basic import BasicManager
from tangram.policy.snapshot import PolicyParams
from tangram.runtime import Runtime, UnknownEnvironmentError
from tangram.service.build import build_runtime
from tangram.service.config import parse_config

pytestmark = pytest.mark.timeout(60)


class FakeExecutor(EnvironmentExecutor):
    """Sleeps for ``sleep <s>``; records environments and the placements it ran."""

    name = "fake"

    def __init__(self):
        self.envs: set[str] = set()
        self.runs: list[tuple[str, str, int]] = []
        self.killed = 0

    async def create_environment(self, env_id, *, image=None, memory_mb=0, labels=None):
        self.envs.add(env_id)

    async def destroy_environment(self, env_id):
        self.envs.discard(env_id)

    async def exec(self, env_id, command, placement, *, timeout_s=None, env=None):
        assert env_id in self.envs
        self.runs.append((env_id, command, placement.dop))
        try:
            if command.startswith("sleep "):
                await asyncio.sleep(float(command.split()[1]))
        except asyncio.CancelledError:
            self.killed += 1
            raise
        return ExecResult(status="succeeded", exit_code=0, stdout=env["TANGRAM_DOP"])


def make_runtime(cores=2, mem=1000, **extra) -> tuple[Runtime, FakeExecutor]:
    ex = FakeExecutor()
    managers = [CountingManager({"cpu@n0": cores, "mem@n0": mem}), *extra.pop("managers", [])]
    return Runtime(Engine(managers), env_executors={"n0": ex}, **extra), ex


def whole(rt: Runtime) -> None:
    rt.check_whole()
    for name, p in rt.engine.pool_states().items():
        if not name.startswith("api:"):
            assert p.free == p.capacity, name


async def test_run_exec_and_environment_lifecycle():
    rt, ex = make_runtime()
    async with rt:
        env = await rt.create_environment(memory_mb=300)
        assert env in ex.envs  # one node: created at once
        r = await rt.exec(env, "echo ${parallel_num}")
        assert r.status == "succeeded" and r.allocation["node"] == "n0" and ex.runs[-1][1] == "echo 1"
        assert rt.engine.pool_states()["mem@n0"].free == 700
        await rt.delete_environment(env)
        assert env not in ex.envs
        whole(rt)
        with pytest.raises(UnknownEnvironmentError):
            await rt.exec(env, "true")
        with pytest.raises(UnschedulableError):
            await rt.exec(None, "true", cpu=3)
        with pytest.raises(DemandError):
            await rt.exec(None, "true", profile="nope")


async def test_cancelling_the_awaiting_task_cancels_the_action():
    rt, ex = make_runtime(cores=1)
    async with rt:
        a = asyncio.create_task(rt.exec(None, "sleep 10"))
        b = asyncio.create_task(rt.exec(None, "sleep 10"))  # queued behind a
        await asyncio.sleep(0.05)
        assert len(rt.engine.running) == 1 and len(rt.engine.waiting) == 1
        b.cancel()
        a.cancel()
        await asyncio.gather(a, b, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert ex.killed == 1 and not rt.engine.running and not rt.engine.waiting
        assert rt.counts[("exec", "cancelled")] == 2
        assert ex.envs == set()  # the one-shot environments are gone
        whole(rt)


async def test_cancel_right_after_start_never_leaks():
    rt, ex = make_runtime(cores=1)
    async with rt:
        first = asyncio.create_task(rt.exec(None, "sleep 0.05"))
        await asyncio.sleep(0)
        aid = rt.submit(rt.build_action("exec", {"cpu": 1}, command="true"))
        await first  # its completion starts `aid`; cancel it before its task ever runs
        assert rt.state(aid) == "running"
        rt.cancel(aid)
        r = await rt.wait(aid)
        assert r.status == "cancelled"
        whole(rt)


async def test_the_safety_net_waits_for_an_executors_own_stop_grace(monkeypatch):
    """An executor whose kill takes seconds (Docker's: calls to the engine) says so (``stop_grace_s``): a run
    it ends and reports within that much past timeout_s keeps its own result (its exit code: a verdict), where
    the net's default grace gave up on it first (no exit code: no verdict)."""
    import tangram.runtime.dispatch as runtime_mod
    from tangram.executors.docker import DockerExecutor
    from tangram.executors.local import LocalExecutor

    monkeypatch.setattr(runtime_mod, "TIMEOUT_GRACE_S", 0.05)
    rt, ex = make_runtime()
    async with rt:
        r = await rt.exec(None, "sleep 0.4", timeout_s=0.05)  # reported 0.35 s past its timeout
        assert r.status == "timeout" and r.exit_code is None
        ex.stop_grace_s = 1.0
        r = await rt.exec(None, "sleep 0.4", timeout_s=0.05)
        assert r.status == "succeeded" and r.exit_code == 0, r
        whole(rt)
    # the real executors' own: past their kill grace, Docker's by the engine calls of its kill rounds
    assert LocalExecutor.stop_grace_s.fget(type("L", (), {"kill_grace_s": 0.5})()) == 2.5
    assert DockerExecutor.stop_grace_s.fget(type("D", (), {"kill_grace_s": 0.5})()) == 15.5


async def test_timeout_safety_net_when_the_executor_ignores_it(monkeypatch):
    import tangram.runtime.dispatch as runtime_mod

    monkeypatch.setattr(runtime_mod, "TIMEOUT_GRACE_S", 0.05)
    rt, ex = make_runtime()
    async with rt:
        r = await rt.exec(None, "sleep 5", timeout_s=0.05)  # FakeExecutor ignores timeout_s
        assert r.status == "timeout" and ex.killed == 1
        # no exit code: the executor never reported the command's end (docs/service.md; the verl rewards
        # raise on it rather than score a response that ran too long)
        assert r.exit_code is None and r.error == "no result within 0.05 s", r
        whole(rt)


class SlowKill(FakeExecutor):
    """Its kill takes ``kill_s`` and goes on through further cancels, as the local executor's grace does;
    it notes whether its units were still held when the kill ended."""

    def __init__(self, rt_box, kill_s=0.3):
        super().__init__()
        self.rt_box, self.kill_s, self.held_at_kill_end = rt_box, kill_s, None

    async def exec(self, env_id, command, placement, *, timeout_s=None, env=None):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            kill = asyncio.ensure_future(asyncio.sleep(self.kill_s))
            await wait_through_cancels(kill)
            self.held_at_kill_end = self.rt_box[0].engine.pool_states()["cpu@n0"].free == 0
            raise


@pytest.mark.parametrize("timeout_s", [None, 20.0], ids=["no timeout", "a timeout (the safety net's task)"])
async def test_a_second_cancel_does_not_give_the_units_back_before_the_kill_ends(timeout_s):
    """A hang-up cancels an action and a DELETE cancels it again while its executor still kills it:
    the action ends, and its core goes back, only once the kill is over (with a timeout the run went
    through asyncio.wait_for, whose wait for the kill a second cancel cut short)."""
    box = []
    ex = SlowKill(box)
    rt = Runtime(Engine([CountingManager({"cpu@n0": 1, "mem@n0": 1000})]), env_executors={"n0": ex})
    box.append(rt)
    async with rt:
        aid = rt.submit(rt.build_action("exec", {"cpu": 1}, command="run", timeout_s=timeout_s))
        await asyncio.sleep(0.05)
        assert rt.state(aid) == "running"
        rt.cancel(aid)
        await asyncio.sleep(0.05)
        rt.cancel(aid)  # during the kill
        r = await rt.wait(aid)
        assert r.status == "cancelled" and ex.held_at_kill_end is True
        whole(rt)


async def test_quota_refill_wakes_the_engine():
    api = BasicManager({"q": {"quota": 1, "period_s": 0.2, "window": "fixed"}})

    class Http:
        async def run(self, request, *, timeout_s=None):
            return ExecResult(status="succeeded", output=request["url"])

    rt, _ = make_runtime(managers=[api], http_executor=Http())
    async with rt:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        rs = await asyncio.gather(*(rt.run(rt.build_action("http", {"api": "q"}, payload={"url": f"http://x/{i}"}))
                                    for i in range(3)))
        assert [r.status for r in rs] == ["succeeded"] * 3
        assert loop.time() - t0 >= 0.3  # one per window
        whole(rt)


async def test_close_cancels_everything():
    rt, ex = make_runtime(cores=1)
    env = await rt.create_environment(memory_mb=10)
    tasks = [asyncio.create_task(rt.exec(env, "sleep 10")) for _ in range(3)]
    await asyncio.sleep(0.05)
    await rt.close()
    await rt.close()  # idempotent
    rs = await asyncio.gather(*tasks)
    assert [r.status for r in rs] == ["cancelled"] * 3
    assert ex.envs == set()
    rt.engine.check_invariants()
    with pytest.raises(RuntimeError):
        rt.submit(rt.build_action("exec", {"cpu": 1}, command="true"))


async def test_close_ends_what_a_cancel_there_starts():
    """Cancelling a waiting head at shutdown runs a round, which may start what waited behind it; that
    action never gets a task, so close ends it too (it was once left running, its core held and its
    waiter hanging)."""
    ex = FakeExecutor()
    rt = Runtime(Engine([CountingManager({"cpu@n0": 2, "mem@n0": 1000})], params=PolicyParams(order="fcfs")),
                 env_executors={"n0": ex})
    env = await rt.create_environment()
    running = rt.submit(rt.build_action("exec", {"cpu": 1}, environment=env, command="sleep 30"))
    head = rt.submit(rt.build_action("exec", {"cpu": 2}, environment=env, command="true"))
    behind = rt.submit(rt.build_action("exec", {"cpu": 1}, environment=env, command="true"))
    await asyncio.sleep(0.05)
    assert [rt.state(a) for a in (running, head, behind)] == ["running", "waiting", "waiting"]  # the head holds
    waiter = asyncio.ensure_future(rt.wait(behind))
    await rt.close()
    assert (await asyncio.wait_for(waiter, 5)).status == "cancelled"
    assert [rt.result(a).status for a in (running, head)] == ["cancelled", "cancelled"]
    whole(rt)


async def test_from_config_builds_a_local_runtime():
    cfg = parse_config({"cpu_nodes": [{"name": "local", "cores": 1, "memory_mb": 128}], "gpu_nodes": []})
    async with await build_runtime(cfg) as rt:
        r = await rt.exec(None, "echo $TANGRAM_DOP")
        assert r.status == "succeeded" and r.stdout == "1\n"
        whole(rt)


async def test_cancelled_environment_creation_is_undone():
    rt, ex = make_runtime()
    gate = asyncio.Event()
    created = ex.create_environment

    async def slow_create(env_id, **kw):
        await gate.wait()
        await created(env_id, **kw)

    ex.create_environment = slow_create
    async with rt:
        task = asyncio.create_task(rt.create_environment(memory_mb=10))
        await asyncio.sleep(0.01)
        task.cancel()  # the client hung up mid-creation
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not rt.env_registry.cleanups:
                break
        assert ex.envs == set() and rt.environments() == []
        whole(rt)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -2.0])
async def test_an_executors_bad_restore_measure_does_not_leave_the_action_running(bad):
    # the engine rejects such a restore before any change: the runtime passes 0 instead, so the
    # action ends and its units come back
    class BadRestore(FakeExecutor):
        async def exec(self, env_id, command, placement, *, timeout_s=None, env=None):
            r = await super().exec(env_id, command, placement, timeout_s=timeout_s, env=env)
            r.restore_s = bad
            return r

    ex = BadRestore()
    rt = Runtime(Engine([CountingManager({"cpu@n0": 2, "mem@n0": 1000})]), env_executors={"n0": ex})
    async with rt:
        r = await rt.exec(None, "sleep 0.01")
        assert r.status == "succeeded"
        assert not rt.engine.running
        whole(rt)


async def test_a_build_that_fails_part_way_closes_what_it_had_made(monkeypatch):
    """A build that fails after a CPU node's executor made its environment root (here its policy's knobs;
    in the field a model factory that does not import) removes that root again: a failed start leaks
    nothing (the root was left behind)."""
    import tempfile

    import tangram.service.build as build

    made = []
    mkdtemp = tempfile.mkdtemp

    def recorded(*args, **kw):
        made.append(mkdtemp(*args, **kw))
        return made[-1]

    def refused(**_):
        raise RuntimeError("refused")

    monkeypatch.setattr(tempfile, "mkdtemp", recorded)
    monkeypatch.setattr(build, "PolicyParams", refused)
    cfg = parse_config({"cpu_nodes": [{"name": "n0", "cores": [0], "memory_mb": 512}]})
    with pytest.raises(RuntimeError, match="refused"):
        await build_runtime(cfg)
    roots = [p for p in made if "tangram-envs-" in p]
    assert roots and not any(os.path.exists(p) for p in roots)
