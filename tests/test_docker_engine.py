"""Real Docker Engine tests: the local sandbox image runs the host's python3,
a running container's CPU allocation can be resized in place through the raw
update endpoint, and killing a process inside a container really stops it.

Selected by ``pytest -k docker``; they skip only when no engine can be started
(see the ``docker_client`` fixture in conftest.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tangram.executors.docker_image import (
    SANDBOX_BINDS,
    SANDBOX_IMAGE,
    cgroup_v1_dir,
    sandbox_run_kwargs,
    update_cpus,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


@pytest.fixture
def docker_sandbox(docker_client):
    """A running sandbox container, always force-removed afterwards."""
    container = docker_client.containers.run(**sandbox_run_kwargs())
    try:
        container.reload()
        assert container.status == "running", container.logs()
        yield container
    finally:
        container.remove(force=True)


def _exec(container, cmd: str) -> tuple[int, str]:
    res = container.exec_run(["sh", "-c", cmd], demux=False)
    return res.exit_code, (res.output or b"").decode(errors="replace")


def _wait(pred, timeout: float = 15.0, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def test_docker_sandbox_image_runs_host_python(docker_client, docker_sandbox):
    assert docker_client.images.get(SANDBOX_IMAGE).id
    assert "/usr" in SANDBOX_BINDS
    res = docker_sandbox.exec_run(["python3", "-c", "print(1+1)"])
    assert res.exit_code == 0, res.output
    assert res.output.decode().strip() == "2"
    # bash and the host's pip-installed pytest work inside too (read-only binds)
    code, out = _exec(docker_sandbox, "bash -c 'echo $BASH_VERSION' && python3 -m pytest --version")
    assert code == 0, out
    assert "pytest" in out
    # and the binds really are read-only
    code, _ = _exec(docker_sandbox, "touch /usr/tangram-must-not-exist")
    assert code != 0


def test_docker_update_cpus_via_raw_endpoint(docker_client, docker_sandbox):
    cid = docker_sandbox.id
    update_cpus(docker_client, cid, cpuset_cpus="0", nano_cpus=int(5e8))

    # the proof: the container's cgroup-v1 files on the host
    cpuset_dir = Path(cgroup_v1_dir(docker_sandbox, "cpuset"))
    cpu_dir = Path(cgroup_v1_dir(docker_sandbox, "cpu"))
    assert cid in str(cpuset_dir) and cid in str(cpu_dir)
    assert (cpuset_dir / "cpuset.cpus").read_text().strip() == "0"
    quota = int((cpu_dir / "cpu.cfs_quota_us").read_text())
    period = int((cpu_dir / "cpu.cfs_period_us").read_text())
    assert quota * 2 == period, (quota, period)  # 0.5 CPU

    # the default layout the brief expects (cgroupfs driver, parent "docker")
    default_cpuset = Path(f"/sys/fs/cgroup/cpuset/docker/{cid}/cpuset.cpus")
    if default_cpuset.exists():
        assert default_cpuset.read_text().strip() == "0"

    # and the engine's own view agrees
    docker_sandbox.reload()
    hc = docker_sandbox.attrs["HostConfig"]
    assert hc["CpusetCpus"] == "0"
    assert hc["NanoCpus"] == 500_000_000

    # resize again (grow): the files follow
    update_cpus(docker_client, cid, cpuset_cpus="0-1", nano_cpus=int(1.5e9))
    assert (cpuset_dir / "cpuset.cpus").read_text().strip() in ("0-1", "0,1")
    assert int((cpu_dir / "cpu.cfs_quota_us").read_text()) * 2 == 3 * period


def test_docker_kill_process_inside_container(docker_client, docker_sandbox):
    api = docker_client.api
    exec_id = api.exec_create(docker_sandbox.id,
                              ["sh", "-c", "echo $$ > /tmp/sleeper.pid; exec sleep 30"])["Id"]
    api.exec_start(exec_id, detach=True)

    def recorded_pid():
        code, out = _exec(docker_sandbox, "cat /tmp/sleeper.pid 2>/dev/null")
        return int(out) if code == 0 and out.strip() else None

    pid = _wait(recorded_pid)
    assert pid, "the exec never recorded its pid"

    def sleeping() -> bool:
        code, out = _exec(docker_sandbox, f"ps -o args= -p {pid}")
        return code == 0 and "sleep 30" in out

    assert _wait(sleeping), "sleep 30 is not running inside the container"
    info = api.exec_inspect(exec_id)
    assert info["Running"] and info["Pid"] > 0
    host_pid = info["Pid"]
    assert any("sleep 30" in " ".join(p) for p in docker_sandbox.top()["Processes"])

    code, out = _exec(docker_sandbox, f"kill -KILL {pid}")
    assert code == 0, out

    assert _wait(lambda: not sleeping()), "sleep 30 survived kill -KILL inside the container"
    code, out = _exec(docker_sandbox, "ps -eo args=")
    assert "sleep 30" not in out, out
    assert _wait(lambda: not api.exec_inspect(exec_id)["Running"])
    assert api.exec_inspect(exec_id)["ExitCode"] == 137  # 128 + SIGKILL
    assert not any("sleep 30" in " ".join(p) for p in docker_sandbox.top()["Processes"])
    assert not Path(f"/proc/{host_pid}").exists() or \
        "sleep" not in Path(f"/proc/{host_pid}/cmdline").read_bytes().decode(errors="replace")
    # the container itself is unaffected
    docker_sandbox.reload()
    assert docker_sandbox.status == "running"
