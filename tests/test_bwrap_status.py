"""bwrap's own failures are not the command's exit status (real bubblewrap, local executor and ``sandbox.run``).

bwrap exits 1 when it cannot set the sandbox up (a bind source that vanished, a mount refused) as it
does when the command exits 1; a test suite's reward would score a sandbox that never started as
failed tests. Its ``--json-status-fd`` report tells them apart: such a run is ``failed`` with no exit
code and bwrap's message, which the verl integration treats as broken, never as a verdict.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from tangram.executors import sandbox as sbx
from tangram.executors.base import FAILED, SUCCEEDED, TIMEOUT, Placement
from tangram.executors.bwrap_status import not_run_error
from tangram.executors.local import LocalExecutor

CAN_SANDBOX, WHY = sbx.probe()
pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not CAN_SANDBOX, reason=f"cannot sandbox here: {WHY}")]
GONE = "Can't find source path"


def _vanishing(monkeypatch, path) -> None:
    """The read-only bind source ``path`` is removed once the sandbox's command line is built, before bwrap
    runs: bwrap fails setting the sandbox up, for real (as when a toolchain directory goes meanwhile)."""
    argv = sbx.Sandbox.argv

    def built_then_gone(self, *a, **kw):
        line = argv(self, *a, **kw)
        if path.exists():
            path.rmdir()
        return line

    monkeypatch.setattr(sbx.Sandbox, "argv", built_then_gone)


@pytest.fixture
async def box(tmp_path):
    tool = tmp_path / "tool"
    tool.mkdir()
    ex = LocalExecutor(str(tmp_path / "envs"), kill_grace_s=0.2, readonly=(str(tool),))
    await ex.create_environment("traj")
    ex.tool = tool
    yield ex
    await ex.close()


def _at(name: str) -> Placement:
    return Placement(name, "local", dop=1, cores=())


async def test_a_sandbox_bwrap_cannot_set_up_has_no_exit_code_and_no_verdict(box, monkeypatch):
    from integrations.verl.verdicts import exec_broken
    from tangram.client import ActionResult

    _vanishing(monkeypatch, box.tool)
    marker = os.path.join(box.env_dir("traj"), "ran")
    r = await box.exec("traj", "touch ran; exit 0", _at("gone"))
    assert r.status == FAILED and r.exit_code is None, r
    assert "bwrap failed while setting up the sandbox, the command did not run" in r.error, r
    assert GONE in r.error and str(box.tool) in r.error, r  # bwrap's own message names the cause
    assert not os.path.exists(marker)
    verdict = ActionResult(id="gone", status=r.status, exit_code=r.exit_code, error=r.error, stderr=r.stderr)
    assert exec_broken(verdict, {}), "a sandbox that never started must not be scored as failed tests"


async def test_the_commands_own_exit_status_is_unchanged(box):
    r = await box.exec("traj", "echo out; exit 0", _at("ok"))
    assert (r.status, r.exit_code, r.error, r.stdout) == (SUCCEEDED, 0, None, "out\n"), r
    r = await box.exec("traj", "exit 1", _at("one"))
    assert (r.status, r.exit_code, r.error) == (FAILED, 1, "exit code 1"), r
    # a command that prints bwrap's words still gets its own exit status: only bwrap's report counts
    r = await box.exec("traj", f"echo \"bwrap: {GONE} /x: No such file or directory\" >&2; exit 1", _at("mimic"))
    assert (r.status, r.exit_code, r.error) == (FAILED, 1, "exit code 1"), r
    r = await box.exec("traj", "kill -9 $$", _at("signal"))
    assert (r.status, r.exit_code) == (FAILED, 137), r  # a command killed by a signal did run
    r = await box.exec("traj", "exec /nonexistent-program", _at("missing"))
    assert (r.status, r.exit_code) == (FAILED, 127), r  # bash ran it: its 127 is the command's


async def test_a_command_killed_at_its_memory_limit_keeps_a_verdict_whoever_the_kernel_killed(box):
    """Memory held in the sandbox's tmpfs, not by a process: the kernel's OOM killer may pick bwrap itself
    (the group's largest process), which then reports no exit code; that is still the command's doing, scored
    as before, never "the sandbox never started". (On the code before, about half of these runs had no exit
    code; the kernel's pick varies, hence several runs.)"""
    if box._limits is None:
        pytest.skip("no memory cgroup here")
    await box.create_environment("small", memory_mb=64)
    for i in range(12):
        r = await box.exec("small", "head -c 200M /dev/zero > /tmp/x; exit 3", _at(f"oom{i}"))
        assert r.status == FAILED and r.exit_code is not None and r.exit_code != 3, r
        assert r.details.get("oom_killed"), r


async def test_much_output_and_stdin_do_not_stall_on_the_status_pipe(box):
    r = await box.exec("traj", "head -c 3000000 /dev/zero; head -c 3000000 /dev/zero >&2; wc -c", _at("big"),
                       stdin=b"x" * 1_000_000)
    assert r.status == SUCCEEDED and len(r.stdout) == 3_000_000 + len("1000000\n") and len(r.stderr) == 3_000_000


def _open_fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


async def test_no_fd_is_left_open_after_results_failures_timeouts_and_cancels(box, monkeypatch):
    await box.exec("traj", "true", _at("warm"))  # the loop's child watcher, bwrap's --help probe
    before = _open_fds()
    for i in range(3):
        assert (await box.exec("traj", "true", _at(f"ok{i}"))).exit_code == 0
        assert (await box.exec("traj", "exit 1", _at(f"one{i}"))).exit_code == 1
        assert (await box.exec("traj", "sleep 30", _at(f"slow{i}"), timeout_s=0.3)).status == TIMEOUT
        task = asyncio.ensure_future(box.exec("traj", "sleep 30", _at(f"cancel{i}")))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    with monkeypatch.context() as m:
        _vanishing(m, box.tool)
        assert (await box.exec("traj", "true", _at("gone"))).exit_code is None
    assert _open_fds() == before


def _groups_named(ex: LocalExecutor, action_id: str) -> list[str]:
    parents = (ex._cg.parents if ex._cg is not None else ()) + (ex._limits.parents if ex._limits is not None else ())
    return [os.path.join(p, d) for p in parents if os.path.isdir(p) for d in os.listdir(p) if d.endswith(action_id)]


async def test_a_failure_before_the_spawn_leaves_no_cgroup_and_no_descriptor(box, monkeypatch):
    """Out of descriptors after the action's cgroups were made (its cpuset and its memory/pids limits):
    the run raises, and neither the groups nor the pipes made for it are left behind."""
    if box._cg is None and box._limits is None:
        pytest.skip("no cgroups here")
    cores = sorted(box.allowed_cores)[:1]
    await box.exec("traj", "true", Placement("warm", "local", dop=1, cores=tuple(cores)))
    before = _open_fds()
    from tangram.executors import seccomp
    seen = []

    def out_of_descriptors():  # after the sandbox's /etc files' pipes were made
        seen.extend(_groups_named(box, "no-fds"))
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(seccomp, "pipe_args", out_of_descriptors)
    with pytest.raises(OSError, match="Too many open files"):
        await box.exec("traj", "true", Placement("no-fds", "local", dop=1, cores=tuple(cores)))
    assert seen, "the action's cgroups exist before the sandbox's files are made"
    assert _groups_named(box, "no-fds") == []
    assert _open_fds() == before  # the /etc pipes made before the failure are closed
    monkeypatch.undo()
    assert (await box.exec("traj", "true", _at("after"))).exit_code == 0
    assert _open_fds() == before


async def test_sandbox_run_tells_a_setup_failure_from_the_commands_exit(tmp_path, monkeypatch):
    work, tool = tmp_path / "work", tmp_path / "tool"
    work.mkdir()
    tool.mkdir()
    box = sbx.Sandbox(readonly=(str(tool),))
    r = await sbx.run(["bash", "-c", "exit 1"], str(work), sandbox=box, timeout_s=30)
    assert (r.exit_code, r.error) == (1, None), r
    before = _open_fds()
    _vanishing(monkeypatch, tool)
    r = await sbx.run(["bash", "-c", "touch ran"], str(work), sandbox=box, timeout_s=30)
    assert r.exit_code is None and GONE in r.error and not (work / "ran").exists(), r
    assert _open_fds() == before


def test_the_report_decides_and_bwraps_message_is_the_error():
    started = b'{ "child-pid": 12, "mnt-namespace": 4026532174 }\n'
    assert not_run_error(started + b'{ "exit-code": 1 }\n', b"bwrap: looks like bwrap\n") is None
    assert not_run_error(started + b'{ "exit-code": 0 }\n', b"", 0) is None
    err = not_run_error(started, b"bwrap: Can't mount proc on /newroot/proc: Operation not permitted\n", 1)
    assert err == ("bwrap failed while setting up the sandbox, the command did not run: "
                   "bwrap: Can't mount proc on /newroot/proc: Operation not permitted")
    err = not_run_error(b"", b"bwrap: Creating new namespace failed: Operation not permitted\n", 1)
    assert err.startswith("bwrap failed before starting the sandbox") and "Creating new namespace" in err
    assert "no message" in not_run_error(b"", b"", 1)
    assert "signal 9" in not_run_error(started, b"", -9)  # killed by someone else: no exit status either


async def test_bwraps_options_are_asked_when_the_executor_is_made_not_by_an_action(tmp_path, monkeypatch):
    """``bwrap --help`` (does it have ``--json-status-fd``?) runs when the executor is made: an action's
    exec makes no blocking call on the event loop for it."""
    sbx._help.cache_clear()
    ex = LocalExecutor(str(tmp_path / "envs"), kill_grace_s=0.2)
    try:
        await ex.create_environment("t")

        def blocking(*a, **kw):
            raise AssertionError(f"a blocking subprocess.run on the event loop: {a}")

        monkeypatch.setattr(sbx.subprocess, "run", blocking)
        r = await ex.exec("t", "exit 1", _at("first"))
        assert (r.status, r.exit_code) == (FAILED, 1), r
    finally:
        await ex.close()
