"""Two CPU nodes as two Docker Engine endpoints on this machine: the main engine and a second
``dockerd`` on its own socket started here. Topology is discovered from the engines; the second
engine is killed mid-run and restarted (node down, then back).

Selected by ``pytest -k docker``; skips only when no engine can be started."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from tangram.core.errors import DemandError, UnavailableError
from tangram.executors.base import FAILED, SUCCEEDED
from tangram.scaleout.cluster import ClusterRuntime, EnvironmentLostError
from tangram.service.build import build_runtime
from tangram.service.config import parse_config
from tests.private_dockerd import PrivateDockerd as SecondDockerd
from tests.private_dockerd import remove_tree as _remove_tree
from tests.helpers import missing

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]


def _engine(d: SecondDockerd):
    try:
        d.start()
    except RuntimeError as exc:
        d.stop()
        missing("a second Docker Engine", "dockerd, run as root", detail=str(exc))
    yield d
    d.stop()
    _remove_tree(d.dir)


@pytest.fixture
def second_dockerd(docker_client):
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        missing("a second Docker Engine", "dockerd, run as root")
    yield from _engine(SecondDockerd())


def _certs(d: str) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (openssl, 1 day)."""
    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca-key.pem", "-out", "ca.pem",
         "-days", "1", "-subj", "/CN=tangram-test-ca")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}-key.pem", "-out", f"{name}.csr",
             "-subj", f"/CN={name}")
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(ext.replace("\\n", "\n"))
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return {k: os.path.join(d, v) for k, v in (("ca_cert", "ca.pem"), ("client_cert", "client.pem"),
                                               ("client_key", "client-key.pem"), ("server_cert", "server.pem"),
                                               ("server_key", "server-key.pem"))}


@pytest.fixture
def tls_dockerd(docker_client):
    if shutil.which("dockerd") is None or shutil.which("openssl") is None or os.geteuid() != 0:
        missing("a TLS Docker Engine", "dockerd and openssl, run as root")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    certs_dir = tempfile.mkdtemp(prefix="tgd-certs-", dir="/tmp")
    certs = _certs(certs_dir)

    from tangram.scaleout.docker_nodes import DockerTls, make_client

    endpoint = f"tcp://127.0.0.1:{port}"
    tls = DockerTls(certs["ca_cert"], certs["client_cert"], certs["client_key"])
    d = SecondDockerd(endpoint,
                      ("--tlsverify", f"--tlscacert={certs['ca_cert']}", f"--tlscert={certs['server_cert']}",
                       f"--tlskey={certs['server_key']}"), lambda: make_client(endpoint, tls=tls, timeout=5))
    d.certs = certs
    try:
        yield from _engine(d)
    finally:
        shutil.rmtree(certs_dir, ignore_errors=True)


async def _until(pred, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.1)


async def test_docker_two_endpoints_discovered_node_down_and_back(docker_client, second_dockerd):
    main = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    cfg = parse_config({
        "cpu_nodes": [{"name": "d1", "executor": "docker", "endpoint": main},
                      {"name": "d2", "executor": "docker", "endpoint": second_dockerd.endpoint}],
        "gpu_nodes": [],
        "scaleout": {"health": {"interval_s": 0.3, "timeout_s": 2.0, "failures": 1}},
    })
    rt = await build_runtime(cfg)
    assert isinstance(rt, ClusterRuntime)
    try:
        info = docker_client.info()
        pools = rt.engine.pool_states()
        for n in ("d1", "d2"):  # discovered: cores a container may use there, the engine's memory
            assert pools[f"cpu@{n}"].capacity == len(os.sched_getaffinity(0)) == info["NCPU"]
            assert pools[f"mem@{n}"].capacity == info["MemTotal"] >> 20
        ncores = pools["cpu@d1"].capacity
        # memory-load balancing puts the second environment on the other node; each stays pinned
        e1 = await rt.create_environment(memory_mb=256, env_id="sx-e1", labels={"suite": "scaleout"})
        e2 = await rt.create_environment(memory_mb=256, env_id="sx-e2", labels={"suite": "scaleout"})
        outs = await asyncio.gather(rt.exec(e1, "echo one > /tmp/mark; hostname"),
                                    rt.exec(e2, "echo two > /tmp/mark; hostname"))
        assert all(o.status == SUCCEEDED for o in outs), outs
        where = {e: rt.engine.placement[e] for e in (e1, e2)}
        assert set(where.values()) == {"d1", "d2"}
        lost = e1 if where[e1] == "d2" else e2
        kept = e2 if lost == e1 else e1
        for _ in range(2):  # later actions stay in their containers on their nodes
            o = await rt.exec(kept, "cat /tmp/mark")
            assert o.status == SUCCEEDED and o.allocation["node"] == where[kept]
        # a long action and one queued behind it on d2, then d2's engine dies (a machine crash: every process)
        long = rt.submit(rt.build_action("exec", {"cpu": ncores}, environment=lost, command="sleep 60"))
        queued = rt.submit(rt.build_action("exec", {"cpu": 1}, environment=lost, command="true"))
        await _until(lambda: long in rt.engine.running)
        await asyncio.sleep(0.5)
        second_dockerd.kill()
        o_long, o_q = await asyncio.wait_for(asyncio.gather(rt.wait(long), rt.wait(queued)), 20)
        for o in (o_long, o_q):
            assert o.status == FAILED and "node 'd2' is down" in o.error, o
            assert o.as_dict()["retryable"] is True  # not the command's fault: may be resubmitted
        assert "d2" in rt.down
        # its container is on d2's disk: the environment waits for the node (503, retry), it is not lost yet
        with pytest.raises(UnavailableError) as err:
            rt.submit(rt.build_action("exec", {"cpu": 1}, environment=lost, command="true"))
        assert err.value.field == "environment" and err.value.retry_after_s >= 1
        assert not any(p.node == "d2" for p in rt.engine.pool_states().values())
        rt.engine.check_invariants()
        # d1 keeps serving, and one-shot actions only go to d1
        assert (await rt.exec(kept, "cat /tmp/mark")).status == SUCCEEDED
        one = await rt.exec(None, "true")
        assert one.status == SUCCEEDED and one.allocation["node"] == "d1"
        # d2 comes back: the environment is reattached, same container, files intact, nothing of `sleep 60` left
        second_dockerd.start()
        await _until(lambda: "d2" not in rt.down and lost not in rt.suspended)
        o = await rt.exec(lost, "cat /tmp/mark; ps -eo args | grep -c '^sleep 60' || true")
        assert o.status == SUCCEEDED and o.allocation["node"] == "d2", o
        assert o.stdout.split() == ["one" if lost == e1 else "two", "0"], o
        # down again, and not back within give_up_s: lost, deleted while down, removed from d2 once it is back
        second_dockerd.kill()
        await _until(lambda: "d2" in rt.down)
        rt.give_up_s = 0.0
        with pytest.raises(EnvironmentLostError) as err:
            rt.submit(rt.build_action("exec", {"cpu": 1}, environment=lost, command="true"))
        assert isinstance(err.value, DemandError) and err.value.field == "environment"
        await rt.delete_environment(lost)
        second_dockerd.start()
        await _until(lambda: "d2" not in rt.down)
        pools = rt.engine.pool_states()
        assert pools["cpu@d2"].free == ncores and pools["mem@d2"].free == pools["mem@d2"].capacity
        e3 = await rt.create_environment(memory_mb=256, env_id="sx-e3", labels={"suite": "scaleout"})
        o3 = await rt.exec(e3, "echo back")
        assert o3.status == SUCCEEDED and o3.stdout == "back\n" and o3.allocation["node"] == "d2", o3
        import docker

        c2 = docker.DockerClient(base_url=second_dockerd.endpoint, timeout=30)
        try:
            await _until(lambda: not c2.containers.list(all=True, filters={"label": f"org.arl-tangram.env={lost}"}))
        finally:
            c2.close()
        rt.engine.check_invariants()
    finally:
        await rt.close()
    rt.check_whole()
    assert docker_client.containers.list(all=True, filters={"label": "suite=scaleout"}) == []


async def test_docker_tcp_tls_endpoint_discovered_and_serving(tls_dockerd):
    import docker

    from tangram.scaleout.docker_nodes import make_client

    c = tls_dockerd.certs
    tls = {"ca_cert": c["ca_cert"], "client_cert": c["client_cert"], "client_key": c["client_key"]}
    # without the client certificate the engine refuses us
    with pytest.raises(docker.errors.DockerException):
        make_client(tls_dockerd.endpoint, timeout=5).ping()
    cfg = parse_config({
        "cpu_nodes": [{"name": "t1", "executor": "docker", "endpoint": tls_dockerd.endpoint, "memory_mb": 2048}],
        "gpu_nodes": [],
        "scaleout": {"docker_nodes": {"t1": {"tls": tls}}, "health": {"interval_s": 0.5}},
    })
    rt = await build_runtime(cfg)
    try:
        p = rt.engine.pool_states()
        assert p["cpu@t1"].capacity == len(os.sched_getaffinity(0)) and p["mem@t1"].capacity == 2048  # config wins
        o = await rt.exec(None, "echo tls")
        assert o.status == SUCCEEDED and o.stdout == "tls\n", o
        await asyncio.sleep(1.2)
        assert not len(rt.down)  # the health pings go through TLS too
    finally:
        await rt.close()
    rt.check_whole()


async def test_docker_node_unreachable_at_start_joins_when_its_engine_answers(docker_client):
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        missing("a second Docker Engine", "dockerd, run as root")
    from tangram.service.config import ConfigError

    d = SecondDockerd()
    main = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    late = {"name": "late", "executor": "docker", "endpoint": d.endpoint}
    # nothing answers and nothing is configured: its topology cannot be known
    with pytest.raises(ConfigError) as err:
        await build_runtime(parse_config({"cpu_nodes": [late], "gpu_nodes": []}))
    assert err.value.field == "cpu_nodes[0].endpoint"
    cfg = parse_config({
        "cpu_nodes": [{"name": "d1", "executor": "docker", "endpoint": main, "memory_mb": 256},
                      {**late, "cores": 1, "memory_mb": 512}],
        "gpu_nodes": [],
        "scaleout": {"health": {"interval_s": 0.3, "failures": 1}},
    })
    rt = await build_runtime(cfg)
    try:
        assert "late" in rt.down and "unreachable at start" in rt.down.reason("late")
        assert (await rt.exec(None, "true")).allocation["node"] == "d1"
        try:
            d.start()
            await _until(lambda: "late" not in rt.down)
            env = await rt.create_environment(memory_mb=400, env_id="sx-late")  # fits only on `late`
            o = await rt.exec(env, "echo here")
            assert o.status == SUCCEEDED and o.allocation["node"] == "late" and o.stdout == "here\n", o
        finally:
            await rt.close()
            d.stop()
            _remove_tree(d.dir)
    finally:
        await rt.close()
    rt.check_whole()


async def test_a_reattach_that_fails_while_the_node_is_up_is_tried_again(docker_client):
    # the engine answers again but cannot yet act on the container (here: paused, so nothing can be
    # run in it); the reattach is retried until it works, not left suspended until give_up_s
    main = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    cfg = parse_config({"cpu_nodes": [{"name": "d1", "executor": "docker", "endpoint": main}], "gpu_nodes": [],
                        "scaleout": {"health": {"interval_s": 30.0}}})
    rt = await build_runtime(cfg)
    assert isinstance(rt, ClusterRuntime)
    try:
        env = await rt.create_environment(memory_mb=128, env_id="sx-retry", labels={"suite": "scaleout"})
        assert (await rt.exec(env, "echo kept > /tmp/mark")).status == SUCCEEDED
        from tangram.executors.docker import ENV_LABEL

        [c] = docker_client.containers.list(filters={"label": f"{ENV_LABEL}={env}"})
        assert rt.node_down("d1", "maintenance")
        assert env in rt.suspended
        c.pause()
        try:
            assert rt.node_up("d1")
            await asyncio.sleep(1.5)  # at least one reattach failed on the paused container
            assert env in rt.suspended
        finally:
            c.unpause()
        await _until(lambda: env not in rt.suspended, timeout_s=30)
        o = await rt.exec(env, "cat /tmp/mark")
        assert o.status == SUCCEEDED and o.stdout == "kept\n", o
        await rt.delete_environment(env)
    finally:
        await rt.close()
