"""A command that leaves its process group *and* clears its environment (``setsid env -i ...``, a double
fork, closed output) still dies with its action on the local executor, in every mode it runs in:
sandboxed or not, with a cgroup (pinned or not) or without one (forced affinity: a PID namespace of its
own). Survivors are looked for in /proc by a command line no other process runs."""
from __future__ import annotations

import itertools
import os
import signal

import pytest

from tangram.executors import sandbox as sbx
from tangram.executors.base import FAILED, SUCCEEDED, TIMEOUT, Placement
from tangram.executors.local import LocalExecutor
from tangram.executors.processes import pid_namespace_prefix
from tests.service_helpers import find_pids

pytestmark = pytest.mark.timeout(60)
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


async def test_a_cancelled_action_leaves_no_detached_process(executor, mark):
    m = mark
    import asyncio

    ex, cores = executor
    task = asyncio.ensure_future(ex.exec("e", DETACHED.format(m=m) + " echo up > up.txt; sleep 30",
                                         Placement("a", "local", dop=1, cores=cores)))
    up = os.path.join(ex.env_dir("e"), "up.txt")
    for _ in range(500):
        if os.path.exists(up) and find_pids(f"sleep {m}"):
            break
        await asyncio.sleep(0.01)
    assert find_pids(f"sleep {m}"), "the detached sleep never started"
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
