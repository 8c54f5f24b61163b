"""The shipped configs: `examples/cluster.yaml` starts on this machine as it is, the multi-node
template validates with `serve --check` without reaching a node, and config values are checked
against the machine (or the Docker Engine) they name."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tangram.client import TangramClient, TangramHTTPError
from tangram.scaleout.docker_nodes import NotOnEngine, topology
from tangram.service.auto import docker_answers, resolve_auto
from tangram.service.config import ConfigError, load_config, parse_config
from tangram.service.launch import start_serve

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)


def _serve(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tangram.cli", "serve", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, **kw)


async def test_shipped_cluster_yaml_starts_on_this_machine_and_writes_its_token(tmp_path):
    token_file = tmp_path / "conf" / "token"
    # the whole output kept: the choice `auto` made is logged
    srv = start_serve(["--config", "examples/cluster.yaml", "--port", "0", "--token-file", str(token_file)],
                      cwd=REPO, tail_lines=None)
    try:
        url = srv.url
        assert srv.wait_for_output(str(token_file)), srv.output()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        async with TangramClient(url) as anon:
            with pytest.raises(TangramHTTPError) as e:
                await anon.stats()
            assert e.value.status == 401
        async with TangramClient(url, token=token) as c:
            stats = await c.stats()
            assert stats["pools"]["cpu@local"]["capacity"] == len(os.sched_getaffinity(0))
            assert {"api:search", "api:pdf"} <= set(stats["pools"])
            env = await c.create_environment(memory_mb=64)
            r = await c.exec(env, "echo started as shipped")
            assert r.ok and r.stdout == "started as shipped\n"
            await c.delete_environment(env)
    finally:
        rc = srv.stop(grace_s=60)
    err = srv.output()
    assert rc == 0, err
    # `auto` picked what this machine offers, and said so
    engine = docker_answers("unix:///var/run/docker.sock")
    assert ("environments are containers" if engine is None else "environments are local working directories") in err


def test_a_second_start_reuses_the_token_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("kept\n")
    token_file.chmod(0o600)
    out = _serve("--config", "examples/cluster.yaml", "--token-file", str(token_file), "--check")
    assert out.returncode == 0, out.stderr
    assert f"token: from {token_file}" in out.stdout and "created" not in out.stdout
    assert token_file.read_text() == "kept\n"


def test_multinode_template_validates_without_reaching_its_nodes():
    # its nodes (tcp://10.0.0.12:2376, /models/..., my_models.teacher) exist only on a real cluster
    out = _serve("--config", "examples/cluster-multinode.yaml", "--check")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("config OK:") and "cpu1 (docker, discovered cores)" in out.stdout
    assert "gpu0 (8 GPUs, 2 services)" in out.stdout
    cfg = load_config(REPO / "examples" / "cluster-multinode.yaml")
    assert {n.executor for n in cfg.cpu_nodes} == {"docker"} and cfg.scaleout is None


def test_check_reports_what_this_machine_lacks(tmp_path):
    missing_core = max(os.sched_getaffinity(0)) + 1
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cpu_nodes:\n  - name: here\n    executor: auto\n    cores: \"0-{missing_core}\"\n")
    out = _serve("--config", str(cfg), "--check")
    assert out.returncode == 2 and "cpu_nodes[0].cores" in out.stderr and str(missing_core) in out.stderr
    cfg.write_text("cpu_nodes:\n  - name: here\n    executor: local\n    memory_mb: 1000000000\n")
    out = _serve("--config", str(cfg), "--check")
    assert out.returncode == 2 and "cpu_nodes[0].memory_mb" in out.stderr and "this machine has" in out.stderr
    cfg.write_text("profiles: [nowhere.json]\n")
    out = _serve("--config", str(cfg), "--check")
    assert out.returncode == 2 and "profiles[0]" in out.stderr


@pytest.mark.parametrize("doc,field", [
    ({"cpu_nodes": [{"name": "a", "executor": "auto", "endpoint": "tcp://10.0.0.1:2376"}]}, "cpu_nodes[0].endpoint"),
    ({"cpu_nodes": [{"name": "a", "executor": "vm"}]}, "cpu_nodes[0].executor"),
])
def test_auto_node_is_this_machine(doc, field):
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert e.value.field == field


def test_auto_without_an_engine_is_the_local_sandbox(tmp_path):
    sock = f"unix://{tmp_path}/no-engine.sock"
    cfg = parse_config({"cpu_nodes": [{"name": "n", "executor": "auto", "endpoint": sock}], "gpu_nodes": []})
    assert "no Docker Engine answers" in docker_answers(sock)
    node = resolve_auto(cfg).cpu_nodes[0]
    assert node.executor == "local" and node.endpoint is None and node.cores == cfg.cpu_nodes[0].cores


def test_docker_node_cores_and_memory_are_checked_against_the_engine():
    with pytest.raises(NotOnEngine) as e:
        topology("n", 4, 8 << 30, None, cores=[0, 1, 63])
    assert e.value.field == "cores" and "[63]" in str(e.value) and "0-3" in str(e.value)
    with pytest.raises(NotOnEngine) as e:
        topology("n", 4, 8 << 30, None, cores=[0, 1], memory_mb=10**6)
    assert e.value.field == "memory_mb"
    assert topology("n", 4, 8 << 30, None, cores=[0, 3], memory_mb=1000).cores == (0, 3)


@pytest.mark.docker
def test_docker_node_with_cores_the_engine_lacks_does_not_start(docker_client, tmp_path):
    ncpu = int(docker_client.info()["NCPU"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cpu_nodes:\n  - name: d\n    executor: docker\n    cores: \"0-{ncpu + 7}\"\n    memory_mb: 512\n"
                   "gpu_nodes: []\n")
    out = _serve("--config", str(cfg), "--port", "0")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "cpu_nodes[0].cores" in out.stderr and "do not exist on that engine" in out.stderr
