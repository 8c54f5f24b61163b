"""Crash safety of ``tangram serve`` with a state directory: SIGKILL the service mid-action, start it
again on the same state, and check that environments are reattached with their files, in-flight actions
are answered failed/retryable, orphans are removed, resubmissions with an Idempotency-Key never run
twice, leases expire, and old results answer 410."""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tangram.service.launch import ServeProcess
from tests.service_helpers import config, find_pids, running_service, start_serve

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)
MARK = f"61.{os.getpid()}"  # a sleep no other process on this machine runs


def _serve(state: Path, cfg: Path) -> ServeProcess:
    return start_serve(["--config", str(cfg), "--port", "0", "--no-auth", "--state-dir", str(state)])


async def _j(r):
    return r.status, await r.json(content_type=None)


async def test_sigkill_then_restart_reattaches_and_fails_in_flight_actions(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cpu_nodes:\n  - {name: here, executor: local, cores: 1, memory_mb: 2048}\ngpu_nodes: []\n")
    state = tmp_path / "state"
    srv = _serve(state, cfg)
    url = srv.url
    try:
        async with aiohttp.ClientSession() as s:
            st, env = await _j(await s.post(f"{url}/v1/environments", json={"memory_mb": 256}))
            assert st == 201
            eid = env["id"]
            body = {"kind": "exec", "environment": eid, "command": "echo once >> runs.txt; echo kept > f.txt"}
            st, first = await _j(await s.post(f"{url}/v1/actions", json=body, headers={"Idempotency-Key": "k1"}))
            assert st == 200 and first["status"] == "succeeded"
            st, again = await _j(await s.post(f"{url}/v1/actions", json=body, headers={"Idempotency-Key": "k1"}))
            assert (st, again["id"]) == (200, first["id"])  # the same action's result, not a second run
            st, slow = await _j(await s.post(f"{url}/v1/actions?wait=false", headers={"Idempotency-Key": "k2"},
                                             json={"kind": "exec", "environment": eid,
                                                   "command": f"sleep {MARK}; echo late >> runs.txt"}))
            assert st == 202
            for _ in range(200):  # running, not merely queued
                st, cur = await _j(await s.get(f"{url}/v1/actions/{slow['id']}"))
                if cur["status"] == "running":
                    break
                await asyncio.sleep(0.05)
        srv.kill()
        (state / "envs" / "here" / "env-orphan").mkdir(parents=True)  # made, marked, never recorded
        _marks(state, state / "envs" / "here").joinpath("env-orphan").touch()
        srv = _serve(state, cfg)
        url = srv.url
        # the sandbox dies with the service (pdeathsig on bwrap, --die-with-parent below it); what a kill
        # landing in the instant before those are armed leaves is swept at start (its cgroups name a dead pid)
        for _ in range(100):
            if not find_pids(f"sleep {MARK}"):
                break
            await asyncio.sleep(0.05)
        assert find_pids(f"sleep {MARK}") == []
        async with aiohttp.ClientSession() as s:
            st, listed = await _j(await s.get(f"{url}/v1/environments"))
            assert [e["id"] for e in listed["environments"]] == [eid]
            st, res = await _j(await s.post(f"{url}/v1/actions",
                                            json={"kind": "exec", "environment": eid, "command": "cat f.txt runs.txt"}))
            assert (st, res["stdout"]) == (200, "kept\nonce\n")  # files intact; nothing ran twice
            st, lost = await _j(await s.get(f"{url}/v1/actions/{slow['id']}"))
            assert st == 200 and lost["status"] == "failed" and lost["retryable"] is True
            st, same = await _j(await s.post(f"{url}/v1/actions", headers={"Idempotency-Key": "k2"},
                                             json={"kind": "exec", "command": "echo resubmitted"}))
            assert same["id"] == slow["id"] and same["retryable"] is True  # told, not silently rerun
            st, _ = await _j(await s.get(f"{url}/v1/actions/{first['id']}"))
            assert st == 200
            st, _ = await _j(await s.get(f"{url}/v1/actions/never-seen"))
            assert st == 404
            assert not (state / "envs" / "here" / "env-orphan").exists()
            assert (await s.delete(f"{url}/v1/environments/{eid}")).status == 204
    finally:
        srv.stop(grace_s=30)
    assert list((state / "envs" / "here").iterdir()) == []  # no directory, no mark


def _marks(state: Path, root: Path) -> Path:
    """Where the service marks the environment directories it made under ``root`` (owned_dirs.py)."""
    with sqlite3.connect(state / "state.sqlite3") as db:
        owner = db.execute("SELECT value FROM meta WHERE key = 'service_id'").fetchone()[0]
    return root / ".tangram-owned" / owner


async def test_a_restart_sweeps_only_what_it_made_in_a_shared_workdir(tmp_path):
    """A node's ``workdir`` may hold a user's files and another service's environments: a restart's
    sweep removes only the directories this service made and no longer records."""
    work = tmp_path / "work"
    (work / "precious").mkdir(parents=True)
    (work / "precious" / "file.txt").write_text("mine")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cpu_nodes:\n  - {name: here, executor: local, cores: 1, memory_mb: 2048, isolation: none,\n"
                   f"      workdir: {work}}}\ngpu_nodes: []\n")
    states = [tmp_path / "state-a", tmp_path / "state-b"]
    srvs = [_serve(st, cfg) for st in states]
    try:
        ids = []
        async with aiohttp.ClientSession() as s:
            for srv in srvs:
                st, env = await _j(await s.post(f"{srv.url}/v1/environments", json={}))
                assert st == 201
                ids.append(env["id"])
        for srv in srvs:
            srv.kill()
        (work / "env-orphan").mkdir()  # service a made it and crashed before recording it
        _marks(states[0], work).joinpath("env-orphan").touch()
        srvs = [_serve(states[0], cfg)]
        assert sorted(p.name for p in work.iterdir() if p.name != ".tangram-owned") == sorted(ids + ["precious"])
        assert (work / "precious" / "file.txt").read_text() == "mine"
        async with aiohttp.ClientSession() as s:
            st, listed = await _j(await s.get(f"{srvs[0].url}/v1/environments"))
            assert [e["id"] for e in listed["environments"]] == [ids[0]]
            assert (await s.delete(f"{srvs[0].url}/v1/environments/{ids[0]}")).status == 204
        assert not (work / ids[0]).exists() and (work / ids[1]).is_dir()  # b's environment waits for b
        assert not _marks(states[0], work).exists()
        assert [p.name for p in _marks(states[1], work).iterdir()] == [ids[1]]
    finally:
        for srv in srvs:
            srv.stop(grace_s=30)


async def test_graceful_restart_keeps_environments(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cpu_nodes:\n  - {name: here, executor: local, cores: 1, memory_mb: 2048}\ngpu_nodes: []\n")
    state = tmp_path / "state"
    srv = _serve(state, cfg)
    url = srv.url
    async with aiohttp.ClientSession() as s:
        eid = (await _j(await s.post(f"{url}/v1/environments", json={})))[1]["id"]
        await s.post(f"{url}/v1/actions", json={"kind": "exec", "environment": eid, "command": "echo 1 > a"})
    assert srv.stop(grace_s=30) == 0
    srv = _serve(state, cfg)
    url = srv.url
    try:
        async with aiohttp.ClientSession() as s:
            st, r = await _j(await s.post(f"{url}/v1/actions",
                                          json={"kind": "exec", "environment": eid, "command": "cat a"}))
            assert r["stdout"] == "1\n"
            await s.delete(f"{url}/v1/environments/{eid}")
    finally:
        srv.stop(grace_s=30)


async def test_a_second_service_on_the_same_state_is_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cpu_nodes:\n  - {name: here, executor: local, cores: 1, memory_mb: 2048}\ngpu_nodes: []\n")
    srv = _serve(tmp_path / "state", cfg)
    try:
        second = subprocess.run([sys.executable, "-m", "tangram.cli", "serve", "--config", str(cfg), "--port", "0",
                                 "--no-auth", "--state-dir", str(tmp_path / "state")], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "in use by another tangram service" in second.stderr
    finally:
        srv.stop(grace_s=30)


async def test_results_are_bounded_then_410_and_idle_environments_are_reclaimed():
    cfg = config(service={"keep_results": 2, "env_ttl_s": 0.3})
    async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
        ids = []
        for i in range(25):
            st, r = await _j(await s.post(f"{svc.url}/v1/actions", json={"kind": "exec", "command": f"echo {i}"}))
            ids.append(r["id"])
        st, body = await _j(await s.get(f"{svc.url}/v1/actions/{ids[10]}"))
        assert st == 410, body  # seen, result no longer kept
        assert (await s.get(f"{svc.url}/v1/actions/{ids[0]}")).status == 404  # past 10 x keep_results: forgotten
        assert (await s.get(f"{svc.url}/v1/actions/{ids[-1]}")).status == 200
        eid = (await _j(await s.post(f"{svc.url}/v1/environments", json={})))[1]["id"]
        for _ in range(4):  # renewed: survives past its TTL
            await asyncio.sleep(0.15)
            assert (await s.post(f"{svc.url}/v1/environments/{eid}/renew")).status == 200
        await asyncio.sleep(1.0)  # not renewed: reclaimed
        st, listed = await _j(await s.get(f"{svc.url}/v1/environments"))
        assert listed["environments"] == []
        assert json.dumps(listed)


@pytest.mark.docker
async def test_docker_node_sigkill_then_restart_reattaches_the_container(tmp_path, docker_client):
    endpoint = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cpu_nodes:\n  - {{name: d0, executor: docker, endpoint: '{endpoint}', cores: 1, memory_mb: 2048}}\n"
                   "gpu_nodes: []\n")
    state = tmp_path / "state"
    srv = _serve(state, cfg)
    url = srv.url
    try:
        async with aiohttp.ClientSession() as s:
            eid = (await _j(await s.post(f"{url}/v1/environments", json={"labels": {"suite": "crash"}})))[1]["id"]
            st, r = await _j(await s.post(f"{url}/v1/actions",
                                          json={"kind": "exec", "environment": eid, "command": "echo kept > /work/f"}))
            assert r["status"] == "succeeded", r
            st, slow = await _j(await s.post(f"{url}/v1/actions?wait=false",
                                             json={"kind": "exec", "environment": eid, "command": f"sleep {MARK}"}))
            for _ in range(200):
                if find_pids(f"sleep {MARK}"):
                    break
                await asyncio.sleep(0.05)
        srv.kill()
        assert find_pids(f"sleep {MARK}")  # an exec outlives its client: still running in the container
        owner = docker_client.containers.list(filters={"label": "suite=crash"})[0].labels["org.arl-tangram.owner"]
        stray = docker_client.containers.run("tangram-sandbox:latest", ["/bin/sleep", "600"], detach=True,
                                             network_mode="none",
                                             labels={"org.arl-tangram.owner": owner, "org.arl-tangram.env": "env-x"},
                                             volumes={"/usr": {"bind": "/usr", "mode": "ro"}})
        srv = _serve(state, cfg)
        url = srv.url
        async with aiohttp.ClientSession() as s:
            st, r = await _j(await s.post(f"{url}/v1/actions",
                                          json={"kind": "exec", "environment": eid, "command": "cat /work/f"}))
            assert r.get("stdout") == "kept\n", r  # the same container, its files intact
            assert find_pids(f"sleep {MARK}") == []  # what the dead service left running was killed
            st, lost = await _j(await s.get(f"{url}/v1/actions/{slow['id']}"))
            assert lost["status"] == "failed" and lost["retryable"] is True
            assert docker_client.containers.list(all=True, filters={"id": stray.id}) == []  # owned, unrecorded
            assert (await s.delete(f"{url}/v1/environments/{eid}")).status == 204
    finally:
        srv.stop(grace_s=30)
    assert docker_client.containers.list(all=True, filters={"label": "suite=crash"}) == []


def test_a_version_1_state_database_migrates_forward(tmp_path):
    import sqlite3

    from tangram.service.state import MIGRATIONS, SCHEMA_VERSION, StateError, StateStore, _statements

    db = sqlite3.connect(tmp_path / "state.sqlite3")
    for stmt in _statements(MIGRATIONS[0]):
        db.execute(stmt)
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    db.execute("INSERT INTO environments VALUES ('env-old', NULL, 64, '{}', 'local', 1.0, 2.0)")
    db.commit()
    db.close()
    store = StateStore(str(tmp_path))
    assert store.schema_version == SCHEMA_VERSION == 2
    assert [(e["id"], e["memory_mb"], e["network"]) for e in store.environments()] == [("env-old", 64, False)]
    store.db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    store.close()
    with pytest.raises(StateError, match="newer than this tangram"):
        StateStore(str(tmp_path))


async def test_several_nodes_sigkill_then_restart_reattaches_each_environment_on_its_own_node(tmp_path):
    """Each environment's node is recorded when it is made there (its first action); a restart reattaches
    it on that node, pinned, with its memory reserved there, and one that never ran waits to be placed."""
    cores = sorted(os.sched_getaffinity(0))
    cfg = tmp_path / "c.yaml"  # two nodes of 1 GiB: two environments of 800 MiB cannot share one
    cfg.write_text("cpu_nodes:\n"
                   f"  - {{name: na, executor: local, cores: [{cores[0]}], memory_mb: 1024}}\n"
                   f"  - {{name: nb, executor: local, cores: [{cores[-1]}], memory_mb: 1024}}\n"
                   "gpu_nodes: []\n")
    state = tmp_path / "state"
    srv = _serve(state, cfg)
    url = srv.url
    try:
        async with aiohttp.ClientSession() as s:
            envs = [(await _j(await s.post(f"{url}/v1/environments", json={"memory_mb": 800})))[1]["id"]
                    for _ in range(2)]
            idle = (await _j(await s.post(f"{url}/v1/environments", json={"memory_mb": 800})))[1]["id"]
            where = {}
            for e in envs:
                st, r = await _j(await s.post(f"{url}/v1/actions", json={
                    "kind": "exec", "environment": e, "command": f"echo {e} > mine.txt; pwd"}))
                assert r["status"] == "succeeded", r
                where[e] = r["allocation"]["node"]
            assert sorted(where.values()) == ["na", "nb"]
        srv.kill()
        srv = _serve(state, cfg)
        url = srv.url
        async with aiohttp.ClientSession() as s:
            st, listed = await _j(await s.get(f"{url}/v1/environments"))
            assert sorted(e["id"] for e in listed["environments"]) == sorted(envs + [idle])
            # pinned and reserved before any action: each node's memory holds its environment's 800 MiB
            st, stats = await _j(await s.get(f"{url}/v1/stats"))
            assert stats["pools"]["mem@na"]["free"] == stats["pools"]["mem@nb"]["free"] == 224, stats["pools"]
            for e in envs:
                st, r = await _j(await s.post(f"{url}/v1/actions", json={
                    "kind": "exec", "environment": e, "command": "cat mine.txt"}))
                assert (r["status"], r["stdout"], r["allocation"]["node"]) == ("succeeded", f"{e}\n", where[e]), r
            # the environment that never ran is there, and is made on a node with room when it first runs
            # (none now: both are full; it waits until one is deleted)
            st, waiting = await _j(await s.post(f"{url}/v1/actions?wait=false",
                                                json={"kind": "exec", "environment": idle, "command": "ls"}))
            await asyncio.sleep(0.3)
            st, cur = await _j(await s.get(f"{url}/v1/actions/{waiting['id']}"))
            assert cur["status"] == "waiting", cur
            assert (await s.delete(f"{url}/v1/environments/{envs[0]}")).status == 204
            for _ in range(100):
                st, cur = await _j(await s.get(f"{url}/v1/actions/{waiting['id']}"))
                if cur["status"] == "succeeded":
                    break
                await asyncio.sleep(0.05)
            assert cur["status"] == "succeeded" and cur["allocation"]["node"] == where[envs[0]], cur
            for e in (envs[1], idle):
                assert (await s.delete(f"{url}/v1/environments/{e}")).status == 204
    finally:
        srv.stop(grace_s=30)
    for node in ("na", "nb"):
        assert list((state / "envs" / node).iterdir()) == []


async def test_the_default_state_directory_is_keyed_by_the_nodes_not_the_port(tmp_path, monkeypatch):
    monkeypatch.delenv("TANGRAM_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    nodes = "cpu_nodes:\n  - {name: here, executor: local, cores: 1, memory_mb: 2048}\ngpu_nodes: []\n"
    (tmp_path / "a.yaml").write_text(nodes)
    (tmp_path / "b.yaml").write_text("# the same nodes, another file\n" + nodes)
    srv = start_serve(["--config", str(tmp_path / "a.yaml"), "--port", "0", "--no-auth"])
    url = srv.url
    try:
        async with aiohttp.ClientSession() as s:
            eid = (await _j(await s.post(f"{url}/v1/environments", json={})))[1]["id"]
            st, r = await _j(await s.post(f"{url}/v1/actions", json={"kind": "exec", "environment": eid,
                                                                     "command": "echo kept > f"}))
            assert r["status"] == "succeeded"
        # a second service on the same nodes (another file, another port) would book the same cores: refused
        second = subprocess.run([sys.executable, "-m", "tangram.cli", "serve", "--config", str(tmp_path / "b.yaml"),
                                 "--port", "0", "--no-auth"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "in use by another tangram service" in second.stderr
        srv.kill()
        [state] = list((tmp_path / "xdg" / "tangram").iterdir())
        assert len(state.name) == 16 and (state / "state.sqlite3").exists()
        srv = start_serve(["--config", str(tmp_path / "b.yaml"), "--port", "0", "--no-auth"])  # any port
        url2 = srv.url
        async with aiohttp.ClientSession() as s:
            st, r = await _j(await s.post(f"{url2}/v1/actions", json={"kind": "exec", "environment": eid,
                                                                      "command": "cat f"}))
            assert r.get("stdout") == "kept\n", r
            assert (await s.delete(f"{url2}/v1/environments/{eid}")).status == 204
    finally:
        srv.stop(grace_s=30)


def test_the_default_state_key_tells_hosts_and_gpu_or_api_only_services_apart(monkeypatch):
    import yaml

    from tangram.service.config import parse_config
    from tangram.service.recover import default_state_dir

    def key(text):
        return default_state_dir(parse_config(yaml.safe_load(text)))

    gpu_a = "cpu_nodes: []\ngpu_nodes: [{name: ga, gpus: [0], device: cpu}]\n"
    gpu_b = "cpu_nodes: []\ngpu_nodes: [{name: gb, gpus: [0], device: cpu}]\n"
    api = "cpu_nodes: []\ngpu_nodes: []\napi_pools: {search: {concurrency: 2}}\n"
    assert len({key(gpu_a), key(gpu_b), key(api)}) == 3  # no CPU nodes: still apart
    assert key(gpu_a) == key("# the same, another file\n" + gpu_a)
    here = key(gpu_a)
    monkeypatch.setattr("socket.gethostname", lambda: "another-host-sharing-this-home")
    assert key(gpu_a) != here


def test_a_damaged_state_database_is_named_and_holds_no_lock(tmp_path):
    """A file that is not a database, or a schema version that is not a number, is a clear error naming
    the file; the directory's lock is released, so the next start (once the file is moved) is not told
    that another service holds it."""
    from tangram.service.state import StateError, StateStore

    (tmp_path / "state.sqlite3").write_bytes(os.urandom(8192))
    with pytest.raises(StateError, match="state.sqlite3 cannot be read"):
        StateStore(str(tmp_path))
    (tmp_path / "state.sqlite3").unlink()
    store = StateStore(str(tmp_path))  # not "in use by another tangram service"
    store.db.execute("UPDATE meta SET value='x' WHERE key='schema_version'")
    store.close()
    with pytest.raises(StateError, match="cannot be read"):
        StateStore(str(tmp_path))
    StateStore(str(tmp_path / "other")).close()


def test_serve_on_a_damaged_state_database_exits_with_the_reason(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cpu_nodes:\n  - {name: here, executor: local, cores: 1, memory_mb: 2048}\ngpu_nodes: []\n")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.sqlite3").write_bytes(b"\x00not a database" * 512)
    done = subprocess.run([sys.executable, "-m", "tangram.cli", "serve", "--config", str(cfg), "--port", "0",
                           "--no-auth", "--state-dir", str(tmp_path / "state")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "service.state_dir" in done.stderr and "cannot be read" in done.stderr
    assert "Traceback" not in done.stderr
