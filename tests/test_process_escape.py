"""A command that leaves its process group *and* clears its environment (``setsid env -i ...``, a double
fork, closed output) still dies with its action on the local executor, in every mode it runs in:
sandboxed or not, with a cgroup (pinned or not) or without one (forced affinity: a PID namespace of its
own). Survivors are looked for in /proc by a command line no other process runs."""
from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tangram.executors import sandbox as sbx
from tangram.executors.base import FAILED, SUCCEEDED, TIMEOUT, Placement
from tangram.executors.local import LocalExecutor
from tangram.executors.processes import pid_namespace_prefix
from tests.service_helpers import find_pids

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parent.parent
CAN_SANDBOX, WHY = sbx.probe()
CORE = min(os.sched_getaffinity(0))
_SEQ = itertools.count(1)

# every way out of a marked process group at once: new session, empty environment, output closed
DETACHED = "setsid env -i sh -c 'exec sleep {m}' </dev/null >/dev/null 2>&1 &"
# ... and orphaned (its parent exits at once: no process tree leads to it any more)
DOUBLE_FORK = "env -i sh -c '(setsid sleep {m} </dev/null >/dev/null 2>&1 &)'"
# the command goes on only once its escapee runs (-x: the sleep's own command line, not this script's)
RUNNING = "until pgrep -x -f 'sleep {m}' >/dev/null; do sleep 0.01; done; echo running"


MODES = [  # (sandbox, isolation, cores): which mechanism is expected to hold the action
    pytest.param(("none", "auto", (CORE,)), id="none-cgroup-pinned"),
    pytest.param(("none", "auto", ()), id="none-cgroup-unpinned"),  # a tracking-only cgroup
    pytest.param(("none", "affinity", (CORE,)), id="none-affinity-pidns"),
    pytest.param(("none", "affinity", ()), id="none-nocores-pidns"),
    pytest.param(("sandbox", "auto", (CORE,)), id="sandbox-cgroup",
                 marks=pytest.mark.skipif(not CAN_SANDBOX, reason=f"cannot sandbox here: {WHY}")),
    pytest.param(("sandbox", "affinity", ()), id="sandbox-bwrap-pidns",
                 marks=pytest.mark.skipif(not CAN_SANDBOX, reason=f"cannot sandbox here: {WHY}")),
]


@pytest.fixture(params=MODES)
async def executor(request, tmp_path):
    sandbox, isolation, cores = request.param
    ex = LocalExecutor(str(tmp_path / "envs"), isolation=isolation, sandbox=sandbox, kill_grace_s=0.2)
    if sandbox == "none" and ex.isolation == "affinity" and ex._pidns is None:
        pytest.skip("this machine gives neither a cgroup nor a PID namespace (the documented limit)")
    if isolation == "auto" and ex.isolation == "affinity":
        pytest.skip("no writable cgroup hierarchy")
    await ex.create_environment("e")
    yield ex, cores
    await ex.close()


@pytest.fixture
def mark():
    """A sleep duration no other process on this machine runs; any survivor is killed afterwards."""
    m = f"71.{os.getpid()}{next(_SEQ):03d}"
    yield m
    for pid in find_pids(f"sleep {m}"):
        os.kill(pid, signal.SIGKILL)


def _tracked_by(ex: LocalExecutor, details: dict) -> str:
    if details.get("cgroup"):
        return "cgroup"
    if details.get("pid_namespace"):
        return "pid namespace"
    return "bwrap pid namespace" if ex.sandbox == "sandbox" else "nothing"


async def test_a_detached_process_with_no_environment_dies_at_the_timeout(executor, mark):
    m = mark
    ex, cores = executor
    r = await ex.exec("e", f"{DETACHED} {RUNNING}; sleep 30".format(m=m), Placement("a", "local", dop=1, cores=cores),
                      timeout_s=2)
    assert (r.status, r.stdout) == (TIMEOUT, "running\n"), r
    assert _tracked_by(ex, r.details) != "nothing"
    assert find_pids(f"sleep {m}") == []


async def test_an_orphaned_process_with_no_environment_dies_when_the_command_exits(executor, mark):
    m = mark
    ex, cores = executor
    r = await ex.exec("e", f"{DOUBLE_FORK}; {RUNNING}; {DETACHED} echo done".format(m=m),
                      Placement("a", "local", dop=1, cores=cores))
    assert (r.status, r.stdout) == (SUCCEEDED, "running\ndone\n"), r
    assert find_pids(f"sleep {m}") == []


async def test_the_callers_variables_cannot_keep_the_command_out_of_what_kills_it(executor, mark):
    """``env`` names functions and options bash acts on at its start. They once reached the bash that
    joins the action's cgroup (``echo $$ > cgroup.procs``, an ``echo`` the caller could define away),
    so the command ran outside the group its kill empties; now they reach the command alone."""
    m = mark
    ex, cores = executor
    hostile = {"BASH_FUNC_echo%%": "() { :; }", "BASH_ENV": "/dev/null"}
    r = await ex.exec("e", f"{DETACHED} {RUNNING}; sleep 30".format(m=m), Placement("a", "local", dop=1, cores=cores),
                      timeout_s=2, env=hostile)
    assert (r.status, r.stdout) == (TIMEOUT, ""), r  # its echo is the caller's: it prints nothing
    assert _tracked_by(ex, r.details) != "nothing"
    assert find_pids(f"sleep {m}") == []


async def test_a_cancelled_action_leaves_no_detached_process(executor, mark):
    m = mark
    ex, cores = executor
    task = asyncio.ensure_future(ex.exec("e", DETACHED.format(m=m) + " echo up > up.txt; sleep 30",
                                         Placement("a", "local", dop=1, cores=cores)))
    up = os.path.join(ex.env_dir("e"), "up.txt")
    t0 = time.monotonic()
    deadline = t0 + 40  # a loaded machine starts it late
    # the sleep itself, not a process on its way to it (setsid, env, sh -c 'exec ...'): one that is
    # still exec'ing shows no command line for a moment, and a second look could miss it
    while not (os.path.exists(up) and find_pids(f"sleep {m}", exact=True)) and time.monotonic() < deadline and (
            not task.done()):
        await asyncio.sleep(0.01)
    # a command that ended (or an exec that raised) before its escapee was seen says why
    ended = (task.exception() or task.result()) if task.done() else None
    assert find_pids(f"sleep {m}", exact=True), (f"the detached sleep never started: after {time.monotonic() - t0:.1f} s, "
                                     f"up.txt {'written' if os.path.exists(up) else 'missing'}, "
                                     f"the action {'ended: ' + repr(ended) if task.done() else 'still running'}")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert find_pids(f"sleep {m}") == []


@pytest.mark.skipif(pid_namespace_prefix() is None, reason="no PID namespace on this machine")
async def test_a_command_in_its_own_pid_namespace_keeps_its_exit_code_input_output_and_grace(tmp_path):
    ex = LocalExecutor(str(tmp_path / "envs"), isolation="affinity", sandbox="none", kill_grace_s=0.3)
    try:
        await ex.create_environment("e")
        p = Placement("a", "local", dop=1, cores=(CORE,))
        r = await ex.exec("e", "read x; echo got $x; echo err >&2; exit 3", p, stdin=b"in\n")
        assert (r.status, r.exit_code, r.stdout, r.stderr) == (FAILED, 3, "got in\n", "err\n")
        assert r.details["pid_namespace"] is True
        # SIGTERM first, as everywhere: a command that traps it gets its grace to clean up
        r = await ex.exec("e", "trap 'echo cleaned > c.txt; exit 0' TERM; while :; do sleep 0.02; done", p,
                          timeout_s=0.3)
        assert r.status == TIMEOUT
        with open(os.path.join(ex.env_dir("e"), "c.txt")) as f:
            assert f.read() == "cleaned\n"
    finally:
        await ex.close()


# a root command's way out of --kill-child: new credentials clear the parent-death signal, a new session
# leaves the process group; exec'd, the escapee is the namespace's init itself
AS_NOBODY = "setsid setpriv --reuid=65534 --regid=65534 --clear-groups sleep {m}"


@pytest.mark.skipif(pid_namespace_prefix() is None, reason="no PID namespace on this machine")
@pytest.mark.skipif(os.geteuid() != 0, reason="changing credentials needs a root service")
@pytest.mark.parametrize("command", [
    pytest.param(f"echo running; exec {AS_NOBODY}", id="the-init-itself"),
    pytest.param(f"{AS_NOBODY} </dev/null >/dev/null 2>&1 & {RUNNING}; sleep 30", id="a-child-of-the-init"),
])
async def test_a_process_that_changes_its_credentials_and_session_dies_with_its_pid_namespace(tmp_path, mark,
                                                                                                command):
    m = mark
    ex = LocalExecutor(str(tmp_path / "envs"), isolation="affinity", sandbox="none", kill_grace_s=0.2)
    try:
        await ex.create_environment("e")
        p = Placement("a", "local", dop=1, cores=(CORE,))
        r = await ex.exec("e", command.format(m=m), p, timeout_s=3)
        assert (r.status, r.stdout, r.details["pid_namespace"]) == (TIMEOUT, "running\n", True), r
        assert find_pids(f"sleep {m}") == []
        # cancelled rather than timed out: the same
        task = asyncio.ensure_future(ex.exec("e", command.format(m=m), p))
        deadline = time.monotonic() + 20  # a loaded machine starts it late
        while not find_pids(f"sleep {m}", exact=True) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert find_pids(f"sleep {m}", exact=True), "the escapee never started"
        await asyncio.sleep(0.1)  # time for it to leave the process group
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert find_pids(f"sleep {m}") == []
    finally:
        await ex.close()


@pytest.mark.skipif("--mount-proc" not in (pid_namespace_prefix() or ()), reason="no /proc of its own here")
async def test_a_command_in_its_own_pid_namespace_sees_its_own_processes(tmp_path, mark):
    """ps, pgrep, pkill and /proc/$! speak of the namespace's processes, as $$ and $! do."""
    m = mark
    ex = LocalExecutor(str(tmp_path / "envs"), isolation="affinity", sandbox="none")
    try:
        await ex.create_environment("e")
        r = await ex.exec("e", f"sleep {m} & pkill -x -f 'sleep {m}'; echo pkill=$?; wait $!; echo status=$?; "
                               "head -1 /proc/$$/status; echo $$; ps -e -o pid= | wc -l",
                          Placement("a", "local", dop=1, cores=(CORE,)))
        assert r.details["pid_namespace"] is True and ex.process_tracking == "pid_namespace"
        # ps sees itself, wc and the command's bash: nothing of the host
        assert r.stdout.split("\n")[:6] == ["pkill=0", "status=143", "Name:\tbash", "1", "3", ""], r
        assert find_pids(f"sleep {m}") == []
    finally:
        await ex.close()


# ---------------------------------------------------------------------- #
# Docker executor: one container per environment, no cgroup or namespace per action inside it


@pytest.fixture
async def docker_ex(docker_client):
    from tangram.executors.docker import DockerExecutor

    ex = DockerExecutor(docker_client, kill_grace_s=0.3)
    await ex.create_environment("escape")
    yield ex
    await ex.destroy_environment("escape")
    await ex.close()


@pytest.mark.docker
@pytest.mark.timeout(120)
async def test_docker_detached_and_orphaned_processes_with_no_environment_die_with_their_action(docker_ex, mark):
    p = Placement("a", None, dop=1)
    m1, m2, m3 = f"{mark}1", f"{mark}2", f"{mark}3"
    r = await docker_ex.exec("escape", f"{DOUBLE_FORK}; {RUNNING}; {DETACHED} echo done".format(m=m1), p)
    assert (r.status, r.stdout) == (SUCCEEDED, "running\ndone\n"), r
    assert find_pids(f"sleep {m1}") == []
    r = await docker_ex.exec("escape", f"{DETACHED} {RUNNING}; sleep 30".format(m=m2), p, timeout_s=3)
    assert (r.status, r.stdout) == (TIMEOUT, "running\n"), r
    assert find_pids(f"sleep {m2}") == []
    # the environment goes on: its next action runs, and leaves nothing either
    r = await docker_ex.exec("escape", f"{DOUBLE_FORK}; {RUNNING}".format(m=m3), p)
    assert (r.status, r.stdout) == (SUCCEEDED, "running\n"), r
    assert find_pids(f"sleep {m3}") == []


@pytest.mark.docker
@pytest.mark.timeout(120)
async def test_docker_an_action_ending_spares_what_a_concurrent_action_of_its_environment_still_runs(docker_ex, mark):
    import asyncio

    mine, helper, cleared = f"{mark}1", f"{mark}2", f"{mark}3"
    # B: a double-forked helper that keeps B's mark, and a child with a cleared environment still under B
    b = asyncio.ensure_future(docker_ex.exec(
        "escape", f"(sleep {helper} &); env -i sleep {cleared} & "
                  f"until pgrep -x -f 'sleep {cleared}' >/dev/null; do sleep 0.01; done; echo b-up > b-up; sleep 3",
        Placement("b", None, dop=1)))
    for _ in range(500):
        if find_pids(f"sleep {cleared}", exact=True) and find_pids(f"sleep {helper}", exact=True):
            break
        await asyncio.sleep(0.01)
    assert find_pids(f"sleep {helper}", exact=True) and find_pids(f"sleep {cleared}", exact=True)
    r = await docker_ex.exec("escape", f"{DOUBLE_FORK}; {RUNNING}".format(m=mine), Placement("a", None, dop=1))
    assert (r.status, r.stdout) == (SUCCEEDED, "running\n"), r
    assert find_pids(f"sleep {mine}") == []  # A's escapee is gone ...
    assert find_pids(f"sleep {helper}", exact=True) and find_pids(f"sleep {cleared}", exact=True)  # ... B's are not
    rb = await b
    assert rb.status == SUCCEEDED, rb
    assert find_pids(f"sleep {helper}") == [] and find_pids(f"sleep {cleared}") == []  # they end with B


_CRASHING_SERVICE = """
import asyncio, os, signal, sys
from tangram.executors.base import Placement
from tangram.executors.local import LocalExecutor

async def main():
    ex = LocalExecutor(sys.argv[1], isolation="affinity", sandbox="none")
    assert ex._pidns is not None, "no PID namespace here"
    await ex.create_environment("e")
    asyncio.ensure_future(ex.exec("e", sys.argv[2], Placement("a", "local", dop=1)))
    await asyncio.sleep(0.5)
    print("running", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the service crashes mid-action

asyncio.run(main())
"""


async def test_an_unsandboxed_command_in_its_pid_namespace_dies_with_a_crashed_service(tmp_path, mark):
    """A ``kill -9`` of the service: the PID namespace's ``unshare`` gets the parent-death signal (as bwrap
    does in the sandbox) and takes the command with it; it once went on, on cores the restarted service
    hands out again."""
    if LocalExecutor(str(tmp_path / "probe"), isolation="affinity", sandbox="none")._pidns is None:
        pytest.skip("this machine gives no PID namespace (the documented limit)")
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASHING_SERVICE, str(tmp_path / "envs"), f"sleep {mark}",
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    out, _ = await asyncio.wait_for(p.communicate(), 30)
    assert (p.returncode, out) == (-signal.SIGKILL, b"running\n")
    deadline = time.monotonic() + 5
    while find_pids(f"sleep {mark}") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert find_pids(f"sleep {mark}") == []


@pytest.mark.docker
@pytest.mark.timeout(120)
async def test_docker_a_cancel_during_the_timeouts_kill_still_kills(docker_client, mark):
    """A command that ignores SIGTERM times out, and a cancel (a DELETE, the shutdown) comes during its
    grace: the kill goes on to SIGKILL before the action ends. The cancel once cut the kill short there,
    and the command ran on in its container on cores handed to the next action."""
    import asyncio

    from tangram.executors.docker import DockerExecutor

    ex = DockerExecutor(docker_client, kill_grace_s=2.0)
    await ex.create_environment("grace")
    try:
        task = asyncio.ensure_future(ex.exec("grace", f"trap '' TERM; sleep {mark}; sleep {mark}",
                                             Placement("a", None, dop=1), timeout_s=1.0))
        await asyncio.sleep(1.8)  # past the timeout, within the TERM grace
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        deadline = time.monotonic() + 5
        while find_pids(f"sleep {mark}") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert find_pids(f"sleep {mark}") == []
    finally:
        await ex.destroy_environment("grace")
        await ex.close()
