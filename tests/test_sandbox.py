"""The local executor's sandbox against the attacks an LLM-written command could try, through the real
service (real HTTP, real bubblewrap, real cgroups): nothing of the host, of the service or of another
environment is in reach, memory and process counts are bounded, and nothing outlives its action."""
from __future__ import annotations

import asyncio
import os

import pytest

from tangram.executors import sandbox as sbx
from tangram.executors.processes import pid_namespace_mode
from tests.service_helpers import FORK_BOMB, assert_whole, config, find_pids, running_service

CAN_SANDBOX, WHY = sbx.probe()
MARK = f"61.{os.getpid()}"  # a sleep no other process on this machine runs
pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not CAN_SANDBOX, reason=f"cannot sandbox here: {WHY}")]
try:
    sbx.Limits("tangram-limits")  # the parent the local executor uses
    HAS_LIMITS = True
except OSError:
    HAS_LIMITS = False


async def test_host_secrets_and_the_token_are_out_of_reach(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    monkeypatch.setenv("TANGRAM_TOKEN", "s3cret-token")  # the service's own environment must not leak
    cfg = config(service={"token_file": str(token_file)})
    async with running_service(cfg) as svc, svc.client(token="s3cret-token") as c:
        env = await c.create_environment()
        r = await c.exec(env, f"cat /etc/shadow; cat {token_file}; echo \"tok=$TANGRAM_TOKEN\"; id -u; "
                              f"ls /root /home /var 2>&1; touch /usr/x /x 2>&1; echo mine > own.txt && cat own.txt")
        assert r.allocation["isolation"] == "sandbox"
        assert "s3cret" not in r.stdout + r.stderr
        assert "root:x:" not in r.stdout and "root:$" not in r.stdout  # no shadow/passwd line of the host
        assert "tok=\n" in r.stdout and "mine\n" in r.stdout
        if os.geteuid() == 0:
            assert "\n65534\n" in f"\n{r.stdout}"  # an unprivileged uid on the host
        assert not os.path.exists("/usr/x") and not os.path.exists("/x")
        # a nested action with the stolen token is impossible: the service's port is not reachable either
        r = await c.exec(env, f"exec 3<>/dev/tcp/127.0.0.1/{svc.port} && echo connected")
        assert r.status == "failed" and "connected" not in r.stdout
        await c.delete_environment(env)


async def test_another_environment_is_invisible():
    async with running_service() as svc, svc.client() as c:
        a, b = await c.create_environment(), await c.create_environment()
        assert (await c.exec(a, "echo top-secret > secret.txt")).ok
        r = await c.exec(b, "cat ../*/secret.txt; ls .. ; cat $HOME/../*/secret.txt")
        assert "top-secret" not in r.stdout
        assert (await c.exec(a, "cat secret.txt")).stdout == "top-secret\n"  # the owner still has it
        for e in (a, b):
            await c.delete_environment(e)


@pytest.mark.skipif(not HAS_LIMITS, reason="no writable memory/pids cgroups")
async def test_memory_is_bounded_by_the_environment():
    async with running_service() as svc, svc.client() as c:
        env = await c.create_environment(memory_mb=256)
        r = await c.exec(env, "python3 -c 'b = bytearray(3 << 30); print(len(b))'", timeout_s=60)
        assert r.status == "failed" and r.exit_code == 137, r
        assert "memory limit (256 MiB)" in (r.error or ""), r.error
        ok = await c.exec(env, "python3 -c 'b = bytearray(64 << 20); print(len(b))'")
        assert ok.ok and ok.stdout.strip() == str(64 << 20)
        await c.delete_environment(env)
        assert_whole(svc.runtime)


@pytest.mark.skipif(not HAS_LIMITS, reason="no writable memory/pids cgroups")
async def test_process_count_is_bounded_and_nothing_outlives_the_action():
    async with running_service() as svc, svc.client() as c:
        env = await c.create_environment()
        await c.exec(env, f"cat > forker.py <<'EOF'\n{FORK_BOMB}EOF")
        r = await c.exec(env, "python3 forker.py", timeout_s=60)
        assert r.ok, r
        assert int(r.stdout) < sbx.DEFAULT_PIDS_MAX, r.stdout  # stopped by pids.max, not by the loop bound
        assert find_pids("forker.py") == []
        # the service kept serving
        assert (await c.exec(env, "echo alive")).stdout == "alive\n"
        await c.delete_environment(env)
        assert_whole(svc.runtime)


async def test_no_way_out_of_the_action_cgroup():
    async with running_service() as svc, svc.client() as c:
        env = await c.create_environment()
        r = await c.exec(env, "echo $BASHPID > /sys/fs/cgroup/cpuset/cgroup.procs; ls /sys/fs/cgroup 2>&1; "
                              f"setsid sleep {MARK} & echo started")
        assert "started" in r.stdout
        await asyncio.sleep(0.2)
        assert find_pids(f"sleep {MARK}") == []  # killed with its action
        with open("/sys/fs/cgroup/cpuset/cgroup.procs") as f:
            root_members = set(f.read().split())
        assert not any(int(p) in root_members for p in find_pids(f"sleep {MARK}"))
        await c.delete_environment(env)


async def test_a_callers_variables_act_on_the_command_alone_never_on_the_host(tmp_path):
    """The ``env`` field: variables that bash or the dynamic linker act on at a program's start once ran
    the caller's code on the host, as the service's user, outside the sandbox and before the command
    joined its cgroup (the host-side chain got them). They now reach the command alone, after the
    sandbox and the user drop, and cannot replace the executor's own ``TANGRAM_*``."""
    host = tmp_path / "host-side"  # outside every environment: a sandboxed command cannot write here
    hostile = {"BASH_ENV": f"$(touch {host}-bash-env)", "BASH_FUNC_echo%%": f"() {{ touch {host}-func; }}",
               "SHELLOPTS": "xtrace", "PS4": f"$(touch {host}-ps4)", "LD_PRELOAD": f"{tmp_path}/no-such.so",
               "TANGRAM_DOP": "99", "TANGRAM_ACTION_TOKEN": "forged", "A": "kept as given"}
    async with running_service() as svc, svc.client() as c:
        env = await c.create_environment()
        for cpu in (1, {"min": 1, "max": 2}):  # with cores (a cgroup join first) and as placed
            r = await c.exec(env, 'printf "%s|%s|%s\\n" "$A" "$TANGRAM_DOP" "$TANGRAM_ACTION_TOKEN"', cpu=cpu,
                             env=hostile)
            assert r.ok, r
            a, dop, token = r.stdout.splitlines()[-1].split("|")
            assert (a, dop) == ("kept as given", str(r.allocation["dop"])) and token not in ("", "forged")
            assert r.allocation["isolation"] == "sandbox"
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing ran on the host
        await c.delete_environment(env)


async def test_healthz_and_allocation_report_the_isolation():
    async with running_service() as svc, svc.client() as c:
        r = await c.exec(None, "true")
        assert r.allocation["isolation"] == "sandbox"
        import aiohttp

        async with aiohttp.ClientSession() as s, s.get(f"{svc.url}/healthz") as h:
            health = await h.json()
        assert (health["isolation"], health["process_tracking"]) == ({"local": "sandbox"}, {"local": "sandbox"})


async def test_isolation_none_is_explicit_and_warned(caplog):
    cfg = config(cpu_nodes=[{"name": "local", "executor": "local", "cores": 1, "memory_mb": 1024,
                             "isolation": "none"}])
    async with running_service(cfg) as svc, svc.client() as c:
        r = await c.exec(None, "id -u")
        assert r.allocation["isolation"] == "none" and r.stdout.strip() == str(os.geteuid())
        import aiohttp

        async with aiohttp.ClientSession() as s, s.get(f"{svc.url}/healthz") as h:
            tracking = (await h.json())["process_tracking"]["local"]
        # an unsandboxed action: its cgroup where the hierarchy is writable, else its PID namespace or token
        assert tracking == ("cgroup" if svc.runtime.env_executors["local"].isolation.startswith("cgroup")
                            else pid_namespace_mode()), tracking
    assert any("isolation none" in rec.getMessage() for rec in caplog.records)


async def test_output_is_capped_and_flagged_truncated():
    import aiohttp

    async with running_service() as svc, aiohttp.ClientSession() as s:
        body = {"kind": "exec", "command": "head -c 20000000 /dev/zero | tr '\\0' x; echo tail >&2"}
        async with s.post(f"{svc.url}/v1/actions", json=body) as r:
            res = await r.json()
        assert res["status"] == "succeeded" and len(res["stdout"]) == 8 << 20 and res["stderr"] == "tail\n"
        assert res["truncated"] is True
        async with s.post(f"{svc.url}/v1/actions", json={"kind": "exec", "command": "echo small"}) as r:
            assert "truncated" not in await r.json()


async def test_network_only_when_the_environment_asks_and_the_node_allows():
    from tangram.client import TangramHTTPError

    async with running_service() as svc, svc.client() as c:
        with pytest.raises(TangramHTTPError) as e:
            await c._request("POST", "/v1/environments", json={"network": True})
        assert (e.value.status, e.value.field) == (422, "network")
    cfg = config(cpu_nodes=[{"name": "local", "executor": "local", "cores": 1, "memory_mb": 1024,
                             "allow_network": True}])
    async with running_service(cfg) as svc, svc.client() as c:
        probe = f"exec 3<>/dev/tcp/127.0.0.1/{svc.port} && echo connected"
        closed = await c.create_environment()
        assert "connected" not in (await c.exec(closed, probe)).stdout  # not asked: loopback of its own
        body = await c._request("POST", "/v1/environments", json={"network": True}, expect=(201,))
        opened = body["id"]
        assert (await c.exec(opened, probe)).stdout == "connected\n"
        for env in (closed, opened):
            await c.delete_environment(env)


async def test_a_networked_environment_goes_to_a_node_that_gives_one():
    """Two nodes, one with ``allow_network``: a networked environment is pinned at once to that node (its
    memory reserved there, and made there), so its actions run where the network is. It was placed by
    its first action like any other, on either node, and on the other one every action failed."""
    cfg = config(cpu_nodes=[{"name": "closed", "executor": "local", "cores": 2, "memory_mb": 4096},
                            {"name": "open", "executor": "local", "cores": 1, "memory_mb": 1024,
                             "allow_network": True}])
    async with running_service(cfg) as svc, svc.client() as c:
        envs = [(await c._request("POST", "/v1/environments", json={"network": True, "memory_mb": 256},
                                  expect=(201,)))["id"] for _ in range(3)]
        probe = f"exec 3<>/dev/tcp/127.0.0.1/{svc.port} && echo connected"
        for env in envs:
            r = await c.exec(env, probe, cpu=1)
            assert (r.allocation["node"], r.stdout) == ("open", "connected\n"), r
        assert svc.runtime.engine.pool_states()["mem@open"].free == 1024 - 3 * 256
        from tangram.service.app import STATE_KEY

        rows = {r["id"]: r["node"] for r in svc.app[STATE_KEY].environments()}
        assert [rows[e] for e in envs] == ["open"] * 3  # recorded: a restart keeps the pin and the files
        from tangram.client import TangramHTTPError

        with pytest.raises(TangramHTTPError) as e:  # no room left where the network is: not now
            await c._request("POST", "/v1/environments", json={"network": True, "memory_mb": 512})
        assert (e.value.status, e.value.field) == (503, "network")
        assert len(svc.runtime.environments()) == 3  # the refused one is gone
        for env in envs:
            await c.delete_environment(env)
        assert_whole(svc.runtime)


async def test_read_only_paths_under_tmp_stay_visible(tmp_path):
    """A toolchain or project that lives under /tmp (a venv, a fresh clone) is bound over the private /tmp,
    read-only; the rest of the host's /tmp stays hidden."""
    shared = tmp_path / "project"
    shared.mkdir()
    (shared / "data.txt").write_text("visible\n")
    (tmp_path / "secret.txt").write_text("hidden\n")
    work = tmp_path / "work"
    work.mkdir()
    box = sbx.Sandbox(readonly=(str(shared),))
    box.prepare_workdir(str(work))
    argv = box.argv(str(work), ["bash", "-c", f"cat {shared}/data.txt; cat {tmp_path}/secret.txt 2>&1; "
                                              f"touch {shared}/x 2>&1 || echo read-only"])
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out = (await proc.communicate())[0].decode()
    assert "visible\n" in out and "hidden" not in out and "read-only" in out
    assert not (shared / "x").exists()


async def test_system_calls_that_open_the_kernel_are_filtered():
    """The seccomp filter (built with libseccomp): no new namespace (so no user namespace to regain
    capabilities in), no mount, no bpf; ordinary programs (threads, subprocesses) run as before."""
    from tangram.executors import seccomp

    assert seccomp.unavailable() is None  # pyseccomp is a dependency and libseccomp2 is on every Debian
    probe = ("import ctypes, os, threading, subprocess\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "def call(nr, *a):\n"
             "    return 'ok' if libc.syscall(nr, *a) != -1 else os.strerror(ctypes.get_errno())\n"
             "print('userns', call(272, 0x10000000))\n"   # unshare(CLONE_NEWUSER)
             "print('netns', call(272, 0x40000000))\n"    # unshare(CLONE_NEWNET)
             "print('mount', call(165, b'none', b'/tmp', b'tmpfs', 0, None))\n"
             "print('bpf', call(321, 0, None, 0))\n"
             "t = threading.Thread(target=print, args=('thread ok',)); t.start(); t.join()\n"
             "print(subprocess.run(['echo', 'child ok'], capture_output=True, text=True).stdout.strip())\n")
    async with running_service() as svc, svc.client() as c:
        env = await c.create_environment()
        await c.exec(env, f"cat > probe.py <<'EOF'\n{probe}EOF")
        r = await c.exec(env, "grep Seccomp: /proc/self/status; python3 probe.py; unshare -U true 2>&1 | head -1")
        assert r.ok, r
        lines = r.stdout.splitlines()
        assert lines[0].split() == ["Seccomp:", "2"], lines  # a filter is loaded
        assert lines[1:7] == ["userns Operation not permitted", "netns Operation not permitted",
                              "mount Operation not permitted", "bpf Operation not permitted",
                              "thread ok", "child ok"], lines
        assert "unshare:" in lines[7], lines
        await c.delete_environment(env)


async def test_the_private_tmp_is_size_limited(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    box = sbx.Sandbox(tmp_mb=16)
    r = await sbx.run(["bash", "-c", "head -c 8M /dev/zero > /tmp/a && echo fits; "
                                     "head -c 16M /dev/zero 2>&1 > /tmp/b; df -m /tmp | tail -1"],
                      str(work), sandbox=box, timeout_s=30)
    out = r.stdout.decode()
    assert "fits" in out and "No space left on device" in out, out
    assert out.splitlines()[-1].split()[1] == "16", out  # the tmpfs's size in MiB
    assert list(work.iterdir()) == []  # nothing of it landed in the work directory
