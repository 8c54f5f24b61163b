"""The Docker executor's defaults against hostile commands and callers, on the real Docker Engine:
memory and pids limits without being asked, no privileges to gain, internal labels no caller can set,
images from the allow-list only, and output capped while it streams."""
from __future__ import annotations

import pytest

from tangram.executors.base import FAILED, SUCCEEDED, Placement
from tangram.executors.docker import DEFAULT_PIDS_MAX, ENV_LABEL, DockerExecutor
from tangram.executors.docker_image import SANDBOX_LABEL

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


@pytest.fixture
async def hard(docker_client):
    ex = DockerExecutor(docker_client, kill_grace_s=0.3, max_output_bytes=1 << 20, default_memory_mb=256)
    yield ex
    await ex.close()


async def test_limits_and_privileges_by_default(docker_client, hard):
    await hard.create_environment("hard-a")  # no memory_mb asked
    hc = docker_client.containers.get(hard.container_id("hard-a")).attrs["HostConfig"]
    assert hc["Memory"] == 256 << 20 and hc["MemorySwap"] == 256 << 20
    assert hc["PidsLimit"] == DEFAULT_PIDS_MAX
    assert "no-new-privileges:true" in hc["SecurityOpt"] and hc["CapDrop"] == ["ALL"]
    assert hc["NetworkMode"] == "none"
    r = await hard.exec("hard-a", "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status", Placement("p", None, dop=1))
    assert r.status == SUCCEEDED and "CapEff:\t0000000000000000" in r.stdout and "NoNewPrivs:\t1" in r.stdout
    # 3 GiB in a 256 MiB environment: the kernel kills it, the container and the service go on
    r = await hard.exec("hard-a", "python3 -c 'b = bytearray(3 << 30)'", Placement("m", None, dop=1), timeout_s=60)
    assert r.status == FAILED and r.exit_code == 137, r
    assert (await hard.exec("hard-a", "echo alive", Placement("q", None, dop=1))).stdout == "alive\n"


async def test_caller_labels_cannot_overwrite_internal_ones(docker_client, hard):
    with pytest.raises(ValueError, match="reserved"):
        await hard.create_environment("hard-b", labels={ENV_LABEL: "someone-else"})
    await hard.create_environment("hard-b", labels={"task": "t1"})
    labels = docker_client.containers.get(hard.container_id("hard-b")).labels
    assert labels[ENV_LABEL] == "hard-b" and labels[SANDBOX_LABEL] == "1" and labels["task"] == "t1"


async def test_only_allowed_images_and_never_a_pull(docker_client, hard):
    before = {i.id for i in docker_client.images.list()}
    with pytest.raises(ValueError, match="not an allowed image"):
        await hard.create_environment("hard-c", image="alpine:latest")
    assert {i.id for i in docker_client.images.list()} == before
    assert "hard-c" not in hard._envs


async def test_output_is_capped_while_it_streams(hard):
    await hard.create_environment("hard-d")
    r = await hard.exec("hard-d", "head -c 50000000 /dev/zero | tr '\\0' x; echo done >&2",
                        Placement("o", None, dop=1), timeout_s=60)
    assert r.status == SUCCEEDED, r
    assert len(r.stdout) == 1 << 20 and r.details["truncated"] is True and r.stderr == "done\n"


# --------------------------------------------------------------------------
# The attacks the local sandbox is probed with (tests/test_sandbox.py), against a Docker node of the
# real service: real HTTP, real engine, real containers.
# --------------------------------------------------------------------------
import asyncio  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from tests.service_helpers import FORK_BOMB, N_CORES, assert_whole, config, find_pids, running_service  # noqa: E402

MARK = f"62.{os.getpid()}"  # a sleep no other process on this machine runs


def _docker_service(**service):
    endpoint = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    return config(cpu_nodes=[{"name": "d0", "executor": "docker", "endpoint": endpoint, "cores": N_CORES,
                              "memory_mb": 4096}], **({"service": service} if service else {}))


async def test_host_secrets_the_token_and_the_service_are_out_of_reach(docker_client, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    monkeypatch.setenv("TANGRAM_TOKEN", "s3cret-token")  # the service's own environment must not leak
    with open("/etc/shadow") as f:
        shadow_root = f.readline().strip()
    prefix = os.path.realpath(sys.prefix)  # bound read-only into the container
    async with running_service(_docker_service(token_file=str(token_file))) as svc, \
            svc.client(token="s3cret-token") as c:
        env = await c.create_environment(labels={"suite": "docker-attack"})
        r = await c.exec(env, f"cat /etc/shadow {token_file} ~/.config/tangram/token; echo \"tok=$TANGRAM_TOKEN\"; "
                              f"ls /root/.config /var/lib/docker 2>&1; test -S /var/run/docker.sock && echo sock; "
                              f"touch /usr/x {prefix}/x 2>&1; echo mine > own.txt && cat own.txt")
        assert r.allocation["isolation"] == "docker-cpuset"
        out = r.stdout + r.stderr
        assert "s3cret" not in out and shadow_root not in out and "sock\n" not in r.stdout, out
        assert "tok=\n" in r.stdout and "mine\n" in r.stdout
        assert "Read-only file system" in r.stdout
        assert not os.path.exists("/usr/x") and not os.path.exists(f"{prefix}/x")
        # a nested action with a stolen token is impossible: only loopback, the service's port unreachable
        r = await c.exec(env, f"ls /sys/class/net; exec 3<>/dev/tcp/127.0.0.1/{svc.port} && echo connected")
        assert r.status == "failed" and r.stdout == "lo\n", r
        await c.delete_environment(env)
    assert docker_client.containers.list(all=True, filters={"label": "suite=docker-attack"}) == []


async def test_another_environment_is_invisible(docker_client):
    async with running_service(_docker_service()) as svc, svc.client() as c:
        a, b = await c.create_environment(), await c.create_environment()
        assert (await c.exec(a, "echo top-secret > /work/secret.txt")).ok
        r = await c.exec(b, "cat /work/secret.txt ../*/secret.txt; find / -xdev -name secret.txt 2>/dev/null")
        assert "top-secret" not in r.stdout and "secret.txt" not in r.stdout, r
        assert (await c.exec(a, "cat /work/secret.txt")).stdout == "top-secret\n"  # the owner still has it
        for e in (a, b):
            await c.delete_environment(e)


async def test_memory_of_the_environment_is_its_limit(docker_client):
    async with running_service(_docker_service()) as svc, svc.client() as c:
        env = await c.create_environment(memory_mb=128)
        r = await c.exec(env, "python3 -c 'b = bytearray(1 << 30); print(len(b))'", timeout_s=60)
        assert r.status == "failed" and r.exit_code == 137, r
        ok = await c.exec(env, "python3 -c 'b = bytearray(32 << 20); print(len(b))'")
        assert ok.ok and ok.stdout.strip() == str(32 << 20)
        await c.delete_environment(env)
        assert_whole(svc.runtime)


async def test_a_fork_bomb_stops_at_the_pids_limit_and_nothing_outlives_the_action(docker_client):
    async with running_service(_docker_service()) as svc, svc.client() as c:
        env = await c.create_environment()
        await c.exec(env, f"cat > forker.py <<'EOF'\n{FORK_BOMB}EOF")
        r = await c.exec(env, "python3 forker.py", timeout_s=60)
        assert r.ok, r
        assert int(r.stdout) < DEFAULT_PIDS_MAX, r.stdout  # stopped by pids.max, not by the loop bound
        assert find_pids("forker.py") == []  # container processes are host processes: all gone
        left = (await c.exec(env, "ps -eo comm --no-headers")).stdout.split()
        assert "python3" not in left and len(left) <= 6, left  # init, its sleep, this action's bash and ps
        # the same bomb killed by its timeout: the kill itself must not need a fork (the pids are used up)
        r = await c.exec(env, "python3 forker.py; sleep 60", timeout_s=3)
        assert r.status == "timeout", r
        assert find_pids("forker.py") == []
        r = await c.exec(env, "ls forker.py; ps -eo comm --no-headers")  # files kept, nothing left running
        assert r.ok and r.stdout.split()[0] == "forker.py", r
        assert "python3" not in r.stdout.split() and "sleep" in r.stdout.split(), r
        await c.delete_environment(env)
        assert_whole(svc.runtime)


async def test_no_way_out_of_the_container_cgroup_and_no_privilege_to_gain(docker_client):
    async with running_service(_docker_service()) as svc, svc.client() as c:
        env = await c.create_environment(labels={"suite": "docker-attack"})
        cid = docker_client.containers.list(filters={"label": "suite=docker-attack"})[0].id
        run = asyncio.ensure_future(c.exec(
            env, "for g in cpuset memory pids; do echo $BASHPID > /sys/fs/cgroup/$g/cgroup.procs; done 2>&1; "
                 "mount -t tmpfs none /mnt 2>&1; unshare -U true 2>&1; "
                 f"setsid sleep {MARK} & echo started; wait", timeout_s=3))
        for _ in range(100):
            if find_pids(f"sleep {MARK}"):
                break
            await asyncio.sleep(0.05)
        pids = find_pids(f"sleep {MARK}")
        assert pids
        for pid in pids:  # seen from the host: still in the container's own groups
            with open(f"/proc/{pid}/cgroup") as f:
                groups = [line.rstrip("\n").split(":", 2) for line in f]
            for _, ctrls, path in groups:
                if ctrls in ("cpuset", "memory", "pids"):
                    assert cid in path, (ctrls, path)
        r = await run
        assert r.status == "timeout" and "started" in r.stdout, r
        assert r.stdout.count("Read-only file system") == 3, r.stdout
        assert "mount: " in r.stdout and "unshare: " in r.stdout, r.stdout  # no capability, no new namespace
        assert find_pids(f"sleep {MARK}") == []  # the setsid'd sleep died with its action
        await c.delete_environment(env)


async def test_a_creation_whose_answer_was_lost_leaves_no_container(docker_client):
    """The engine made the container but its answer never arrived (it died, the connection broke): the
    executor removes what carries the environment's label as soon as the engine answers again."""
    import requests

    class LosesTheAnswer:  # the real engine; only the reply to the first `run` is lost on the way back
        def __init__(self, client):
            self._client, self.lost = client, 0

        def __getattr__(self, name):
            return getattr(self._client, name)

        @property
        def containers(self):
            outer, real = self, self._client.containers

            class Containers:
                def __getattr__(self, name):
                    return getattr(real, name)

                def run(self, **kw):
                    c = real.run(**kw)
                    if not outer.lost:
                        outer.lost += 1
                        raise requests.exceptions.ConnectionError("Connection aborted.")
                    return c
            return Containers()

    ex = DockerExecutor(LosesTheAnswer(docker_client), default_memory_mb=64)
    try:
        with pytest.raises(requests.exceptions.ConnectionError):
            await ex.create_environment("lost-answer", labels={"suite": "lost-answer"})
        assert docker_client.containers.list(all=True, filters={"label": "suite=lost-answer"}) == []
        await ex.create_environment("lost-answer", labels={"suite": "lost-answer"})  # a retry works
        assert len(docker_client.containers.list(all=True, filters={"label": "suite=lost-answer"})) == 1
    finally:
        await ex.close()
    assert docker_client.containers.list(all=True, filters={"label": "suite=lost-answer"}) == []
