"""Local executor with real cgroups (read back from inside the command) and
the forced sched_setaffinity fallback; timeouts and cancels that really kill
a process tree; persistent environment directories; engine-level leak
checks with the CPU manager."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from tangram.core.engine import Engine, Started
from tangram.core.model import Action
from tangram.executors.base import CANCELLED, FAILED, SUCCEEDED, TIMEOUT, Placement
from tangram.executors.local import AFFINITY, CGROUP_V1, CGROUP_V2, LocalExecutor
from tangram.managers.cpu import CpuManager, CpuNode
from tests.service_helpers import find_pids
from tests.test_basic_manager import drive

pytestmark = pytest.mark.timeout(60)

CORES = sorted(os.sched_getaffinity(0))
LAST = CORES[-1]


def _cgroup_writable() -> bool:
    ex = LocalExecutor(isolation="auto", sandbox="none")
    try:
        return ex.isolation in (CGROUP_V1, CGROUP_V2)
    finally:
        asyncio.run(ex.close())


CGROUPS = _cgroup_writable()


@pytest.fixture
async def local(tmp_path):
    ex = LocalExecutor(str(tmp_path / "envs"), kill_grace_s=0.2, sandbox="none")  # pinning, read back from /sys
    await ex.create_environment("traj")
    yield ex
    await ex.close()


@pytest.fixture(params=["auto", "affinity"])
async def either(tmp_path, request):
    """The executor with cgroups (when writable) and with the forced affinity fallback."""
    ex = LocalExecutor(str(tmp_path / "envs"), isolation=request.param, kill_grace_s=0.2, sandbox="none")
    await ex.create_environment("traj")
    yield ex
    await ex.close()


@pytest.fixture
async def affinity(tmp_path):
    ex = LocalExecutor(str(tmp_path / "envs"), isolation="affinity", kill_grace_s=0.2, sandbox="none")
    await ex.create_environment("traj")
    yield ex
    await ex.close()


@pytest.mark.skipif(not CGROUPS, reason="needs writable cgroups")
async def test_a_cgroup_it_cannot_join_is_no_exit_code_and_no_reward(local, monkeypatch, tmp_path):
    # the group vanished before the process joined it: the command never ran, so the result has
    # no exit code (not the prefix's 125), and the reward path calls it broken, not failed tests
    from integrations.verl.reward import _broken
    from tangram.executors.cgroups import _Group

    assert local.isolation in (CGROUP_V1, CGROUP_V2)  # resolved now: the backend exists
    create = local._cg.create
    monkeypatch.setattr(local._cg, "create", lambda *a: _Group(create(*a).dirs + [str(tmp_path / "gone")]))
    marker = tmp_path / "ran"
    r = await local.exec("traj", f"touch {marker}", Placement("join", "local", dop=1, cores=(LAST,)))
    assert r.status == FAILED and r.exit_code is None and "could not join" in r.error, r
    assert not marker.exists()
    from tangram.client import ActionResult
    assert _broken(ActionResult(id="join", status=r.status, exit_code=r.exit_code, error=r.error), "command")


def _gone(pid: int) -> bool:
    """Dead or a zombie (zombies run nothing; PID 1 here may not reap them)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def _wait_file(path, timeout=5.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path) and open(path).read().strip():
            return open(path).read()
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} never appeared")


# ---------------------------------------------------------------------- #
# isolation really takes effect

CGROUP_PROOF = r"""
grep Cpus_allowed_list /proc/self/status
cpu=$(awk -F: '$2=="cpu" || $2=="cpu,cpuacct" {print $3}' /proc/self/cgroup)
cpuset=$(awk -F: '$2=="cpuset" {print $3}' /proc/self/cgroup)
echo "cpu-group $cpu"
echo "quota $(cat /sys/fs/cgroup/cpu$cpu/cpu.cfs_quota_us) period $(cat /sys/fs/cgroup/cpu$cpu/cpu.cfs_period_us)"
echo "cpuset $(cat /sys/fs/cgroup/cpuset$cpuset/cpuset.cpus)"
echo "dop $TANGRAM_DOP"
"""


@pytest.mark.cgroup
@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup hierarchy (cpuset + cpu)")
async def test_cgroup_cores_and_quota_read_back_from_inside(local):
    assert local.isolation in (CGROUP_V1, CGROUP_V2)
    r = await local.exec("traj", CGROUP_PROOF, Placement("act-1", "local", dop=3, cores=(LAST,), cpu_quota=0.5))
    assert r.status == SUCCEEDED, r
    lines = dict(line.split(None, 1) for line in r.stdout.strip().splitlines())
    assert lines["Cpus_allowed_list:"].strip() == str(LAST)
    assert lines["cpu-group"].startswith("/tangram/") and "act-1" in lines["cpu-group"]
    assert lines["quota"] == "50000 period 100000"  # 0.5 CPU of CFS quota
    assert lines["cpuset"] == str(LAST)
    assert lines["dop"] == "3"
    assert r.details["pinning"] == local.isolation
    # the per-action groups are gone afterwards
    assert all(not os.path.exists(d) for d in r.details["cgroup"])


@pytest.mark.cgroup
@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup hierarchy (cpuset + cpu)")
async def test_cgroup_quota_equal_to_cores_needs_no_cpu_group(local):
    # default quota = number of cores: the exclusive cpuset already bounds it, so no CFS group is made
    r = await local.exec("traj", CGROUP_PROOF, Placement("act-2", "local", dop=len(CORES), cores=tuple(CORES)))
    lines = dict(line.split(None, 1) for line in r.stdout.strip().splitlines())
    assert r.details["cfs_quota"] is False
    if local.isolation == CGROUP_V1:
        assert lines["cpu-group"] == "/" and lines["quota"] == "-1 period 100000"
        assert len(r.details["cgroup"]) == 1  # the cpuset group only
    from tangram.managers.cpu import parse_cpulist

    assert parse_cpulist(lines["Cpus_allowed_list:"]) == CORES


async def test_affinity_fallback_pins_cores(affinity):
    r = await affinity.exec("traj", "grep Cpus_allowed_list /proc/self/status; "
                            "grep Cpus_allowed_list /proc/self/status & wait",
                            Placement("act-3", "local", dop=1, cores=(LAST,)))
    assert r.status == SUCCEEDED, r
    assert r.details["pinning"] == AFFINITY
    assert [line.split()[-1] for line in r.stdout.strip().splitlines()] == [str(LAST), str(LAST)]
    # the event loop thread got its own affinity back
    assert sorted(os.sched_getaffinity(0)) == CORES


async def test_affinity_concurrent_spawns_do_not_mix(affinity):
    cmd = "grep Cpus_allowed_list /proc/self/status"
    rs = await asyncio.gather(*(
        affinity.exec("traj", cmd, Placement(f"c{i}", "local", dop=1, cores=(CORES[i % len(CORES)],)))
        for i in range(8)))
    assert [r.stdout.split()[-1] for r in rs] == [str(CORES[i % len(CORES)]) for i in range(8)]
    assert sorted(os.sched_getaffinity(0)) == CORES


async def test_no_cores_means_no_isolation(local):
    r = await local.exec("traj", "echo $TANGRAM_DOP", Placement("a", None, dop=1))
    assert (r.status, r.stdout, r.details["pinning"]) == (SUCCEEDED, "1\n", "none")


# ---------------------------------------------------------------------- #
# environments, results, errors

async def test_env_dir_persists_across_actions(local):
    p = Placement("a", "local", dop=1, cores=(CORES[0],))
    assert (await local.exec("traj", "echo state > file; mkdir -p sub; pwd", p)).stdout.strip() == local.env_dir("traj")
    r = await local.exec("traj", "cat file; ls -d sub", p)
    assert r.stdout == "state\nsub\n"
    await local.create_environment("other")
    r = await local.exec("other", "cat file", p)
    assert r.status == FAILED and r.exit_code == 1 and "No such file" in r.stderr
    await local.destroy_environment("traj")
    await local.destroy_environment("traj")  # idempotent
    with pytest.raises(ValueError, match="env_id: unknown environment 'traj'"):
        await local.exec("traj", "true", p)


async def test_exit_code_stdout_stderr_and_env(local):
    r = await local.exec("traj", "echo out; echo err >&2; echo $FOO; exit 3",
                         Placement("a", "local", dop=2, cores=(CORES[0],)), env={"FOO": "bar"})
    assert (r.status, r.exit_code, r.stdout, r.stderr, r.error) == (FAILED, 3, "out\nbar\n", "err\n", "exit code 3")


@pytest.mark.parametrize("kwargs, field", [
    ({"env_id": "../x"}, "env_id"),
    ({"env_id": ""}, "env_id"),
])
async def test_bad_env_id(local, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        await local.create_environment(**kwargs)


async def test_bad_placement_and_args(local):
    with pytest.raises(ValueError, match=r"placement.cores: cores \[4096\]"):
        await local.exec("traj", "true", Placement("a", "local", 1, cores=(4096,)))
    with pytest.raises(ValueError, match="placement.cpu_quota"):
        await local.exec("traj", "true", Placement("a", "local", 1, cores=(CORES[0],), cpu_quota=0))
    with pytest.raises(ValueError, match="timeout_s"):
        await local.exec("traj", "true", Placement("a", "local", 1), timeout_s=-1)
    with pytest.raises(ValueError, match="isolation"):
        LocalExecutor(isolation="chroot")


# ---------------------------------------------------------------------- #
# timeouts and cancellation really kill the process tree

# Processes are looked for by their command lines, not by pids the command writes: where the action
# runs in a PID namespace of its own (no cgroup), $$ and $! are that namespace's numbers.
TAG = f"{os.getpid()}"
TREE = (f"echo $$ > leader.pid; sleep 300.{TAG} & echo $! > child.pid; "
        f"(sleep 301.{TAG} & echo $! > grandchild.pid; wait) & sleep 302.{TAG}")


def _tree_gone() -> bool:
    """The leader (its script names every sleep), the child and the grandchild are all gone."""
    return not any(find_pids(f"sleep 30{i}.{TAG}") for i in range(3))


async def test_timeout_kills_sleep_and_children(either):
    ex = either
    t0 = time.monotonic()
    r = await ex.exec("traj", TREE, Placement("t", "local", dop=1, cores=(CORES[0],)), timeout_s=0.5)
    elapsed = time.monotonic() - t0
    assert r.status == TIMEOUT and r.error == "killed after 0.5 s"
    assert elapsed < 0.5 + ex.kill_grace_s + 1.0
    assert os.path.exists(os.path.join(ex.env_dir("traj"), "grandchild.pid"))  # the whole tree was up
    assert _tree_gone()
    for g in r.details.get("cgroup", ()):
        assert not os.path.exists(g)


async def test_timeout_kills_even_an_escaped_setsid_child(either):
    # found through its cgroup, or dies with the action's own PID namespace (affinity mode)
    r = await either.exec("traj", f"setsid sleep 303.{TAG} & echo $! > escaped.pid; sleep 304.{TAG}",
                          Placement("t", "local", dop=1, cores=(CORES[0],)), timeout_s=0.3)
    assert r.status == TIMEOUT
    assert os.path.exists(os.path.join(either.env_dir("traj"), "escaped.pid"))
    assert find_pids(f"sleep 303.{TAG}") == []


async def test_escaped_daemon_holding_output_is_killed_after_normal_exit(either):
    t0 = time.monotonic()
    r = await either.exec("traj", f"setsid sleep 306.{TAG} & echo done",
                          Placement("t", "local", dop=1, cores=(CORES[0],)))
    assert (r.status, r.stdout) == (SUCCEEDED, "done\n")
    assert time.monotonic() - t0 < 1.5
    assert find_pids(f"sleep 306.{TAG}") == []


async def test_sigterm_ignoring_command_gets_sigkill(local):
    t0 = time.monotonic()
    r = await local.exec("traj", "trap '' TERM; echo $$ > ign.pid; while :; do sleep 0.05; done",
                         Placement("t", "local", dop=1, cores=(CORES[0],)), timeout_s=0.3)
    assert r.status == TIMEOUT and r.exit_code == -9
    assert 0.3 + 0.2 <= time.monotonic() - t0 < 2.0  # the grace, then SIGKILL
    assert _gone(int(open(os.path.join(local.env_dir("traj"), "ign.pid")).read()))


async def test_background_leftovers_are_killed_after_normal_exit(local):
    r = await local.exec("traj", "sleep 305 & echo $! > bg.pid; echo done",
                         Placement("t", "local", dop=1, cores=(CORES[0],)))
    assert (r.status, r.stdout) == (SUCCEEDED, "done\n")
    assert _gone(int(open(os.path.join(local.env_dir("traj"), "bg.pid")).read()))


async def test_cancel_kills_before_returning(either):
    ex = either
    task = asyncio.ensure_future(ex.exec("traj", TREE, Placement("c", "local", dop=1, cores=(CORES[0],))))
    d = ex.env_dir("traj")
    await _wait_file(os.path.join(d, "grandchild.pid"))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _tree_gone()  # dead by the time cancel returned
    if ex.isolation != AFFINITY:
        assert [n for n in os.listdir(f"/sys/fs/cgroup/cpuset/{ex.cgroup_parent}") if n.startswith(ex._tag)] == []


async def test_a_second_cancel_during_the_kill_grace_still_kills_before_returning(either):
    """Cancelled again while waiting out the SIGTERM grace (a second DELETE, the shutdown): SIGKILL at
    once, and the task still ends only after the tree is gone, since its cores are freed then."""
    ex = either
    ex.kill_grace_s = 30.0  # the second cancel lands inside it however loaded the machine
    cmd = f"trap '' TERM; sleep 307.{TAG} & echo $! > bg.pid; while :; do sleep 0.05{TAG}; done"
    task = asyncio.ensure_future(ex.exec("traj", cmd, Placement("c", "local", dop=1, cores=(CORES[0],))))
    await _wait_file(os.path.join(ex.env_dir("traj"), "bg.pid"))
    task.cancel()
    await asyncio.sleep(0.05)  # inside the grace: the leader ignored SIGTERM
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert find_pids(f"sleep 307.{TAG}") == [] and find_pids(f"sleep 0.05{TAG}") == []  # the child, the leader


# ---------------------------------------------------------------------- #
# engine + CPU manager + local executor: nothing leaks on errors, timeouts, cancels, crashes

async def test_engine_leak_check_with_errors_timeouts_cancels(local):
    node = CpuNode("local", cores=CORES, memory_mb=1024)
    manager = CpuManager([node])
    engine = Engine([manager])
    commands = {
        "ok": "echo ok",
        "fail": "exit 7",
        "slow": "sleep 30",        # times out
        "crash": "true",           # the executor is handed a bad environment: an exception
        "cancel": "sleep 30",      # cancelled while running
    }
    actions = [Action.build(f"{kind}-{i}", {"cpu": 1}, trajectory=f"traj{i % 2}", mem_mb=100, timeout_s=0.3,
                            payload={"cmd": cmd}) for i, (kind, cmd) in enumerate(commands.items())]
    await local.create_environment("traj0")
    await local.create_environment("traj1")
    seen_cores: dict[str, tuple] = {}

    async def run(s: Started) -> str:
        cores = s.grants["cpu@local"]
        seen_cores[s.action.id] = cores
        env_id = s.action.trajectory if not s.action.id.startswith("crash") else "missing-env"
        try:
            task = asyncio.ensure_future(local.exec(env_id, s.action.payload["cmd"],
                                                    Placement(s.action.id, s.dispatch.node, s.dispatch.dop, cores=cores),
                                                    timeout_s=s.action.timeout_s if "slow" in s.action.id else None))
            if s.action.id.startswith("cancel"):
                await asyncio.sleep(0.1)
                task.cancel()
            return (await task).status
        except asyncio.CancelledError:
            return CANCELLED
        except ValueError:
            return FAILED  # the executor crashed: the driver reports a failure

    statuses = await drive(engine, actions, run)
    assert statuses == {"ok-0": SUCCEEDED, "fail-1": FAILED, "slow-2": TIMEOUT, "crash-3": FAILED,
                        "cancel-4": CANCELLED}
    assert all(len(c) == 1 for c in seen_cores.values())
    engine.check_invariants()
    assert manager.held()["cpu@local"] == {}
    assert manager.held()["mem@local"] == {"traj0": 100, "traj1": 100}
    for t in ("traj0", "traj1"):
        engine.close_trajectory(t)
    engine.check_invariants()
    assert all(p.free == p.capacity for p in engine.pool_states().values())


@pytest.mark.cgroup
@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup hierarchy (cpuset + cpu)")
async def test_groups_of_a_dead_executor_are_swept(tmp_path):
    # an executor killed with -9 leaves its groups; the next one removes them (pid 2**22+1 cannot exist)
    probe = LocalExecutor(str(tmp_path / "probe"))
    if probe.isolation != CGROUP_V1:
        pytest.skip("the stale layout below is cgroup v1's")
    stale = [os.path.join(d, "p4194305-1-x") for d in probe._cg.parents]
    await probe.close()
    for d in stale:
        os.makedirs(d, exist_ok=True)
    ex = LocalExecutor(str(tmp_path / "envs"))
    try:
        assert ex.isolation == CGROUP_V1
        assert not any(os.path.exists(d) for d in stale)
    finally:
        await ex.close()


async def test_a_cancel_at_any_moment_of_the_spawn_returns_and_leaves_nothing(either):
    """Cancelled while its child is being spawned (the pipes connecting), an action still ends at
    once and its whole tree dies. CPython's subprocess_exec, cancelled there, kills only the leader
    and waits until the pipes close: here the forked ``sleep`` held them for its whole run."""
    ex = either
    for i in range(40):
        place = Placement(f"s{i}", "local", dop=1, cores=(CORES[0],))
        task = asyncio.ensure_future(ex.exec("traj", "sleep 77.25; true", place))  # bash forks the sleep
        for _ in range(i % 5):  # 0-4 loop turns: each step of the spawn
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done, f"the cancel after {i % 5} loop turns did not return"
    deadline = time.monotonic() + 5
    while find_pids("sleep 77.25") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert find_pids("sleep 77.25") == []


async def test_finish_spawn_completes_the_spawn_then_raises_the_cancel_at_the_next_await():
    from tangram.executors.processes import finish_spawn

    steps = []

    async def spawn():
        await asyncio.sleep(0.05)
        steps.append("spawned")
        return "child"

    async def caller():
        child = await finish_spawn(spawn())
        steps.append(child)
        await asyncio.sleep(10)  # the cancellation raises here
        steps.append("not reached")

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["spawned", "child"]


@pytest.mark.cgroup
@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup hierarchy (cpuset + cpu)")
@pytest.mark.parametrize("then", ["killed", "ended"])
async def test_a_cancel_during_the_cleanup_still_kills_everything_and_removes_the_group(tmp_path, monkeypatch,
                                                                                        then):
    """A cancel (a second DELETE, the shutdown) that comes while the executor collects what an action left:
    the collection runs to its end and the action's cgroup is removed. It was cut short and the group stayed
    until the next start of the service. ``killed``: the action was being cancelled already; ``ended``:
    its command had exited."""
    from tangram.executors import processes

    ex = LocalExecutor(str(tmp_path / "envs"), kill_grace_s=0.2, sandbox="none")
    if not ex.isolation.startswith("cgroup"):
        pytest.skip("no cgroup isolation here")
    await ex.create_environment("traj")
    real, entered = processes.cleanup, asyncio.Event()

    async def slow_cleanup(*args):
        entered.set()
        await asyncio.sleep(0.5)  # the cancel lands here
        await real(*args)

    monkeypatch.setattr(processes, "cleanup", slow_cleanup)
    command = "sleep 61.4321 & sleep 30" if then == "killed" else "(sleep 61.4321 &); exit 0"
    task = asyncio.ensure_future(ex.exec("traj", command, Placement("cut-cleanup", "local", dop=1, cores=(LAST,))))
    try:
        if then == "killed":
            await asyncio.sleep(0.3)
            task.cancel()
        await asyncio.wait_for(entered.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert find_pids("sleep 61.4321") == []
        left = [d for parent in ex._cg.parents for d in os.listdir(parent) if d.endswith("cut-cleanup")]
        assert left == [] and ex._stale == []
    finally:
        await ex.close()
