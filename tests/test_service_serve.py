"""``tangram serve`` as a real subprocess, the config file, and the profile store."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tangram.client import TangramClient, TangramHTTPError
from tangram.profiles import ProfileStoreError, load_profiles
from tangram.service.config import ConfigError, load_config, parse_config
from tangram.service.launch import ServeProcess
from tests.service_helpers import start_serve

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)


def _start(args: list[str]) -> ServeProcess:
    return start_serve(args, wait_s=30)


async def test_serve_subprocess_with_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("cpu_nodes:\n  - name: here\n    executor: local\n    cores: 1\n    memory_mb: 256\n"
                   "gpu_nodes: []\nscheduler:\n  depth: 2\n  lookahead: 8\n")
    srv = _start(["--config", str(cfg), "--port", "0", "--token-file", str(token)])
    url = srv.url
    try:
        assert url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
        async with TangramClient(url) as anon:
            assert (await anon.health())["status"] == "ok"
            with pytest.raises(TangramHTTPError) as e:
                await anon.stats()
            assert e.value.status == 401
        async with TangramClient(url, token="t0ken") as c:
            env = await c.create_environment(memory_mb=128)
            r = await c.exec(env, "echo served")
            assert r.stdout == "served\n" and r.allocation["node"] == "here"
            rs = await asyncio.gather(*(c.exec(None, "true") for _ in range(20)))
            assert all(x.ok for x in rs)
            s = await c.stats()
            assert s["pools"]["cpu@here"]["capacity"] == 1 and s["pools"]["mem@here"]["free"] == 128
            await c.delete_environment(env)
            assert (await c.stats())["pools"]["mem@here"]["free"] == 256
            # the startup objects are frozen (no collection scans them again) and every pause is counted
            metrics = await (await c._sess().get(f"{url}/metrics")).text()
        frozen = _sample(metrics, "tangram_gc_frozen_objects")
        assert frozen > 10_000, frozen  # the imports alone: aiohttp, yaml, prometheus_client, the service
        assert "startup objects: garbage collections skip them" in srv.output()
        assert _sample(metrics, 'tangram_gc_pause_seconds_count{generation="0"}') > 0  # 20+ actions allocate
    finally:
        rc = srv.stop(grace_s=20)
    assert rc == 0, srv.output()


def _sample(text: str, name: str) -> float:
    """The value of one sample (its name with labels) of a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_serve_reports_config_errors(tmp_path):
    cfg = tmp_path / "bad.yaml"
    # a docker node's memory may be left out (discovered from the engine), not be negative
    cfg.write_text("cpu_nodes:\n  - name: a\n    executor: docker\n    cores: 4\n    memory_mb: -1\n")
    proc = subprocess.run([sys.executable, "-m", "tangram.cli", "serve", "--config", str(cfg)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cpu_nodes[0].memory_mb" in proc.stderr


# One intent per row: the field path a bad config is reported at.
BAD_CONFIGS = [
    ({"colour": 1}, "colour"),
    ({"cpu_nodes": {"a": 1}}, "cpu_nodes"),
    ({"cpu_nodes": [{"name": "a", "executor": "vm"}]}, "cpu_nodes[0].executor"),
    ({"cpu_nodes": [{"name": "a", "executor": "docker", "endpoint": "nope", "cores": 2, "memory_mb": 1}]},
     "cpu_nodes[0].endpoint"),
    ({"cpu_nodes": [{"name": "a", "executor": "docker", "cores": [0, 0], "memory_mb": 1}]}, "cpu_nodes[0].cores"),
    ({"cpu_nodes": [{"name": "a", "executor": "docker", "cores": 4, "memory_mb": 1, "numa": [[0, 1]]}]},
     "cpu_nodes[0].numa"),
    ({"cpu_nodes": [{"name": "a", "executor": "docker", "cores": 4, "memory_mb": 1},
                    {"name": "a", "executor": "docker", "cores": 4, "memory_mb": 1}]}, "cpu_nodes[1].name"),
    ({"gpu_nodes": [{"name": "g", "gpus": 3}]}, "gpu_nodes[0].gpus"),
    ({"gpu_nodes": [{"name": "g", "gpus": 2, "services": [{"name": "m", "state_mb": -1}]}]},
     "gpu_nodes[0].services[0].state_mb"),
    ({"api_pools": {"search": {"quota": 10}}}, "api_pools.search.period_s"),
    ({"api_pools": {"search": {}}}, "api_pools.search"),
    ({"api_pools": [{"name": "s", "concurrency": 0}]}, "api_pools[0].concurrency"),
    ({"api_pools": {"search": {"quota": 10, "period_s": 1, "books": "optimistic"}}}, "api_pools.search.books"),
    ({"api_pools": {"search": {"quota": 10, "period_s": 1, "arrival_margin_s": 0.2, "books": "adaptive"}}},
     "api_pools.search.books"),  # a stated margin is the books
    ({"api_pools": {"search": {"concurrency": 4, "books": "conservative"}}}, "api_pools.search.books"),
    ({"scheduler": {"depth": 0}}, "scheduler.depth"),
    ({"scheduler": {"lookahead": "far"}}, "scheduler.lookahead"),
    ({"scheduler": {"order": "sjf"}}, "scheduler.order"),
    ({"scheduler": {"aging_k": -1}}, "scheduler.aging_k"),
    ({"scheduler": {"offered_load_caps": {"gpu": -0.5}}}, "scheduler.offered_load_caps.gpu"),
    ({"scheduler": {"offered_load_caps": {"gpus": 0.5}}}, "scheduler.offered_load_caps.gpus"),
    ({"scheduler": {"offered_load_caps": [0.5]}}, "scheduler.offered_load_caps"),
    ({"scheduler": {"offered_load_caps": None}}, "scheduler.offered_load_caps"),
    ({"scheduler": {"depth": 0, "order": "sjf"}}, "scheduler.depth"),  # two errors: the first is named
    ({"service": {"port": 70000}}, "service.port"),
    ({"profiles": [3]}, "profiles[0]"),
]


@pytest.mark.parametrize("doc,field", BAD_CONFIGS)
def test_config_errors_name_the_field(doc, field):
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert e.value.field == field, str(e.value)


def test_default_and_example_configs():
    cfg = parse_config({})
    assert cfg.service.host == "127.0.0.1" and cfg.api_pools == ()
    assert len(cfg.cpu_nodes) == 1 and cfg.cpu_nodes[0].executor == "local"
    assert len(cfg.cpu_nodes[0].cores) == len(os.sched_getaffinity(0))
    example = load_config(REPO / "examples" / "cluster-multinode.yaml")
    assert {n.executor for n in example.cpu_nodes} == {"docker"}
    assert example.gpu_nodes and example.gpu_nodes[0].services
    assert example.api_pools


def test_profile_store(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"version": 1, "classes": {
        "suite": {"t1_s": 10.0, "efficiency": {"1": 1.0, "2": 0.9, "4": 0.7}, "samples": 12}}}))
    prof = load_profiles(p)["suite"]
    assert prof.t1_s == 10.0 and abs(prof.elasticity.duration(10.0, 2) - 10.0 / 1.8) < 1e-9
    for bad, field in [
        ({"version": 2, "classes": {}}, "version"),
        ({"version": 1}, "classes"),
        ({"version": 1, "classes": {"x": {"t1_s": 0}}}, "classes.x.t1_s"),
        ({"version": 1, "classes": {"x": {"t1_s": 1, "efficiency": {"2": 1.5}}}}, "classes.x.efficiency[2]"),
    ]:
        p.write_text(json.dumps(bad))
        with pytest.raises(ProfileStoreError) as e:
            load_profiles(p)
        assert e.value.field == field, str(e.value)
    p.write_text("{oops")
    with pytest.raises(ProfileStoreError):
        load_profiles(p)


async def test_serve_raises_its_open_files_limit_so_a_rollout_of_waiting_actions_fits(tmp_path):
    """Started with a soft limit of 256 open files (a login shell's is often 1,024), the service raises
    it to the hard limit: 400 actions waiting at once (a socket each, pipes for the running ones) all
    succeed. Under 256 they failed by the hundreds ("Too many open files" in accept and the spawns)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.fail(f"this machine's hard limit on open files is {hard}: the test needs 2,048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the child inherits it
    try:
        srv = _start(["--port", "0", "--no-auth", "--state-dir", str(tmp_path / "state")])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        limits = Path(f"/proc/{srv.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files")).split()
        want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
        assert int(line[3]) == want, line
        assert "open files limit raised from 256" in srv.output()
        async with TangramClient(srv.url, timeout_s=300) as c:
            rs = await asyncio.gather(*(c.exec(None, "true") for _ in range(400)))
        assert [r.status for r in rs].count("succeeded") == 400, {r.error for r in rs if not r.ok}
    finally:
        rc = srv.stop(grace_s=30)
    assert rc == 0, srv.output()
