"""Docker executor against the real Docker Engine (``docker_client`` fixture:
skips only when no engine can be started). The container's cgroup files,
read from inside and from the host, prove the cores and quota took effect;
a timed-out or cancelled command really stops inside the container; the
engine + CPU manager + Docker executor leak nothing."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from tangram.core.engine import Engine, Started
from tangram.core.model import Action
from tangram.executors.base import CANCELLED, FAILED, SUCCEEDED, TIMEOUT, Placement
from tangram.executors.docker import DockerExecutor
from tangram.executors.docker_image import cgroup_v1_dir
from tangram.managers.cpu import CpuManager, CpuNode
from tests.test_basic_manager import drive

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

CORES = sorted(os.sched_getaffinity(0))
LAST = CORES[-1]


@pytest.fixture
async def docker_ex(docker_client):
    ex = DockerExecutor(docker_client, kill_grace_s=0.3)
    await ex.create_environment("traj", memory_mb=256)
    yield ex
    await ex.close()
    left = docker_client.containers.list(all=True, filters={"label": "org.arl-tangram.env=traj"})
    assert [c for c in left if c.name.startswith("tangram-traj-")] == []


async def _sh(ex: DockerExecutor, cmd: str) -> str:
    r = await ex.exec("traj", cmd, Placement("probe", None, dop=1))
    assert r.status == SUCCEEDED, r
    return r.stdout


INSIDE = r"""
grep Cpus_allowed_list /proc/self/status
echo "cpuset $(cat /sys/fs/cgroup/cpuset/cpuset.cpus)"
echo "quota $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us) period $(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)"
echo "dop $TANGRAM_DOP foo $FOO pwd $(pwd)"
"""


async def test_docker_cores_and_quota_take_effect(docker_client, docker_ex):
    cid = docker_ex.container_id("traj")
    container = docker_client.containers.get(cid)
    assert container.attrs["HostConfig"]["Memory"] == 256 << 20  # mem_limit from memory_mb
    r = await docker_ex.exec("traj", INSIDE, Placement("a1", "local", dop=3, cores=(LAST,), cpu_quota=0.5),
                             env={"FOO": "bar"})
    assert r.status == SUCCEEDED, r
    lines = dict(line.split(None, 1) for line in r.stdout.strip().splitlines())
    assert lines["Cpus_allowed_list:"].strip() == str(LAST)
    assert lines["cpuset"] == str(LAST)
    assert lines["quota"] == "50000 period 100000"
    assert lines["dop"] == "3 foo bar pwd /work"
    assert r.isolation == "docker-cpuset" and r.details["cpu_update"] is True
    # the host side agrees (cgroup v1 files of the container)
    if os.path.isdir("/sys/fs/cgroup/cpuset"):
        assert (Path(cgroup_v1_dir(container, "cpuset")) / "cpuset.cpus").read_text().strip() == str(LAST)
        assert int((Path(cgroup_v1_dir(container, "cpu")) / "cpu.cfs_quota_us").read_text()) == 50000
    # the next action gets other cores and a full-core quota
    r = await docker_ex.exec("traj", INSIDE, Placement("a2", "local", dop=len(CORES), cores=tuple(CORES)))
    lines = dict(line.split(None, 1) for line in r.stdout.strip().splitlines())
    from tangram.core.grants import format_cpulist

    assert lines["cpuset"] == format_cpulist(CORES)
    assert lines["quota"] == f"{len(CORES) * 100000} period 100000"
    # same cores again: no update round trip
    r = await docker_ex.exec("traj", "true", Placement("a3", "local", dop=1, cores=tuple(CORES)))
    assert r.details["cpu_update"] is False


async def test_docker_env_persists_and_results(docker_ex):
    p = Placement("a", "local", dop=1, cores=(CORES[0],))
    r = await docker_ex.exec("traj", "echo state > file; echo out; echo err >&2; exit 5", p)
    assert (r.status, r.exit_code, r.stdout, r.stderr, r.error) == (FAILED, 5, "out\n", "err\n", "exit code 5")
    r = await docker_ex.exec("traj", "cat file", p)
    assert (r.status, r.stdout) == (SUCCEEDED, "state\n")
    with pytest.raises(ValueError, match="env_id: unknown environment 'nope'"):
        await docker_ex.exec("nope", "true", p)
    with pytest.raises(ValueError, match="env_id"):
        await docker_ex.create_environment("a/b")
    with pytest.raises(ValueError, match="placement.cpu_quota"):
        await docker_ex.exec("traj", "true", Placement("a", "local", 1, cores=(0,), cpu_quota=-1))


LIVE = "ps -eo stat=,args= | awk '$1 !~ /^Z/' | grep -E 'sleep 3[01][0-9]' | grep -v grep | wc -l"
ZOMBIES = "ps -eo stat= | grep -c '^Z' || true"
TREE = "sleep 300 & (sleep 301 & wait) & setsid sleep 302 & sleep 303"


async def test_docker_timeout_really_stops_inside_container(docker_ex):
    t0 = time.monotonic()
    r = await docker_ex.exec("traj", TREE, Placement("t", "local", dop=1, cores=(CORES[0],)), timeout_s=0.5)
    elapsed = time.monotonic() - t0
    assert r.status == TIMEOUT and r.error == "killed after 0.5 s"
    assert elapsed < 0.5 + docker_ex.kill_grace_s + 2.0
    assert (await _sh(docker_ex, LIVE)).strip() == "0"  # nothing of the tree runs any more
    await asyncio.sleep(0.2)
    assert (await _sh(docker_ex, ZOMBIES)).strip() == "0"  # PID 1 reaped them


async def test_docker_sigterm_ignoring_command_gets_sigkill(docker_ex):
    t0 = time.monotonic()
    r = await docker_ex.exec("traj", "trap '' TERM; while :; do sleep 0.0501; done",
                             Placement("t", "local", dop=1), timeout_s=0.3)
    assert r.status == TIMEOUT
    elapsed = time.monotonic() - t0
    assert 0.3 + docker_ex.kill_grace_s <= elapsed < 3.0, elapsed  # TERM was ignored: KILL after the grace
    # neither the loop's bash nor its sleeps run any more (the pattern cannot match this probe itself)
    out = await _sh(docker_ex, "ps -eo pid,stat,args | awk '$2 !~ /^Z/' | grep -E 'sleep 0.050[1]' || true")
    assert out.strip() == ""


async def test_docker_cancel_really_stops_inside_container(docker_ex):
    task = asyncio.ensure_future(docker_ex.exec("traj", TREE, Placement("c", "local", dop=1, cores=(CORES[0],))))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await _sh(docker_ex, LIVE)).strip() == "0"


async def test_docker_second_cancel_during_the_grace_still_kills_before_returning(docker_ex):
    """Cancelled again while waiting out the SIGTERM grace (a second DELETE, the shutdown): SIGKILL at
    once, and the task still ends only once nothing of the command runs, since its cores are freed then."""
    docker_ex.kill_grace_s = 30.0  # the second cancel lands inside it however loaded the machine
    task = asyncio.ensure_future(docker_ex.exec("traj", "trap '' TERM; while :; do sleep 0.0502; done",
                                                Placement("c", "local", dop=1, cores=(CORES[0],))))
    probe = "ps -eo pid,stat,args | awk '$2 !~ /^Z/' | grep -cE 'sleep 0.050[2]' || true"
    while (await _sh(docker_ex, probe)).strip() == "0":  # running (the test's timeout bounds this)
        await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.3)  # SIGTERM sent and ignored: the grace runs
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await _sh(docker_ex, probe)).strip() == "0"


async def test_docker_background_leftovers_killed_after_normal_exit(docker_ex):
    r = await docker_ex.exec("traj", "sleep 304 & echo done", Placement("b", "local", dop=1))
    assert (r.status, r.stdout) == (SUCCEEDED, "done\n")
    assert (await _sh(docker_ex, LIVE)).strip() == "0"
    # a daemon that left the session and holds the output: found by its token, the exec still ends
    t0 = time.monotonic()
    r = await docker_ex.exec("traj", "setsid sleep 305 & echo done", Placement("d", "local", dop=1))
    assert (r.status, r.stdout) == (SUCCEEDED, "done\n")
    assert time.monotonic() - t0 < 3.0
    assert (await _sh(docker_ex, LIVE)).strip() == "0"


async def test_docker_engine_leak_check(docker_ex):
    manager = CpuManager([CpuNode("local", cores=CORES, memory_mb=1024)])
    engine = Engine([manager])
    kinds = {"ok": "echo ok", "fail": "exit 2", "slow": "sleep 30", "crash": "true", "cancel": "sleep 30"}
    actions = [Action.build(f"{k}-{i}", {"cpu": 1}, trajectory="traj", mem_mb=128, payload={"cmd": c})
               for i, (k, c) in enumerate(kinds.items())]

    async def run(s: Started) -> str:
        env_id = "missing" if s.action.id.startswith("crash") else "traj"
        try:
            task = asyncio.ensure_future(docker_ex.exec(
                env_id, s.action.payload["cmd"],
                Placement(s.action.id, s.dispatch.node, s.dispatch.dop, cores=s.grants["cpu@local"]),
                timeout_s=0.5 if s.action.id.startswith("slow") else None))
            if s.action.id.startswith("cancel"):
                await asyncio.sleep(0.5)
                task.cancel()
            return (await task).status
        except asyncio.CancelledError:
            return CANCELLED
        except ValueError:
            return FAILED

    statuses = await drive(engine, actions, run)
    assert statuses == {"ok-0": SUCCEEDED, "fail-1": FAILED, "slow-2": TIMEOUT, "crash-3": FAILED,
                        "cancel-4": CANCELLED}
    engine.check_invariants()
    assert manager.held()["cpu@local"] == {}
    engine.close_trajectory("traj")
    engine.check_invariants()
    assert all(p.free == p.capacity for p in engine.pool_states().values())
    assert (await _sh(docker_ex, LIVE)).strip() == "0"


async def test_docker_kill_does_not_wait_behind_running_execs(docker_client):
    # more long commands than the default thread pool has threads: a timeout must still kill promptly
    ex = DockerExecutor(docker_client, kill_grace_s=0.2)
    try:
        await ex.create_environment("many")
        n = (os.cpu_count() or 1) + 6
        longs = [asyncio.ensure_future(ex.exec("many", "sleep 309", Placement(f"l{i}", None, 1))) for i in range(n)]
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        r = await ex.exec("many", "sleep 310", Placement("short", None, 1), timeout_s=0.5)
        assert r.status == TIMEOUT
        assert time.monotonic() - t0 < 5.0
        for t in longs:
            t.cancel()
        results = await asyncio.gather(*longs, return_exceptions=True)
        assert all(isinstance(x, asyncio.CancelledError) for x in results)
        r = await ex.exec("many", LIVE, Placement("probe", None, 1))
        assert r.stdout.strip() == "0"
    finally:
        await ex.close()


async def test_docker_stopped_container_is_started_again_and_a_removed_one_is_a_failed_result(docker_client):
    ex = DockerExecutor(docker_client)
    try:
        await ex.create_environment("dies")
        assert (await ex.exec("dies", "echo kept > f", Placement("w", None, 1))).status == SUCCEEDED
        docker_client.api.kill(ex.container_id("dies"))  # e.g. its engine restarted, or its PID 1 was killed
        r = await ex.exec("dies", "cat f", Placement("x", None, 1, cores=(CORES[0],)))
        assert r.status == SUCCEEDED and r.stdout == "kept\n", r  # started again first, files intact
        docker_client.api.remove_container(ex.container_id("dies"), force=True)
        r = await ex.exec("dies", "true", Placement("y", None, 1))  # gone: nothing to start
        assert r.status == FAILED and r.error.startswith("docker exec in ") and not r.node_down, r  # not retryable
    finally:
        await ex.close()
