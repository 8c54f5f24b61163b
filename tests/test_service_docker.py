"""The service with a Docker node: environments are containers, exec never runs on the host."""
from __future__ import annotations

import os
import socket

import pytest

from tests.service_helpers import N_CORES, assert_whole, config, running_service

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]


async def test_docker_node_runs_actions_in_containers(docker_client):
    endpoint = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    cfg = config(cpu_nodes=[{"name": "d0", "executor": "docker", "endpoint": endpoint,
                             "cores": N_CORES, "memory_mb": 2048}])
    async with running_service(cfg) as svc, svc.client() as c:
        env = await c.create_environment(memory_mb=256, labels={"suite": "docker-test"})
        r = await c.exec(env, "echo hi > /tmp/mark && nproc && hostname")
        assert r.ok, r.stderr
        nproc, host = r.stdout.split()
        assert nproc == "1" and host != socket.gethostname()  # pinned to one core, inside a container
        assert (await c.exec(env, "cat /tmp/mark")).stdout == "hi\n"
        one = await c.exec(None, "test -e /tmp/mark || echo fresh")  # a one-shot container of its own
        assert one.stdout == "fresh\n"
        assert_whole(svc.runtime, live_envs_mem=256)
        await c.delete_environment(env)
        assert_whole(svc.runtime)
    left = docker_client.containers.list(all=True, filters={"label": "suite=docker-test"})
    assert left == []


async def test_docker_node_refuses_images_and_labels_a_caller_may_not_choose(docker_client):
    from tangram.client import TangramHTTPError

    endpoint = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    cfg = config(cpu_nodes=[{"name": "d0", "executor": "docker", "endpoint": endpoint,
                             "cores": N_CORES, "memory_mb": 2048}])
    async with running_service(cfg) as svc, svc.client() as c:
        for kw, field, status in (({"image": "alpine:latest"}, "image", 422),
                                  ({"labels": {"org.arl-tangram.env": "x"}}, "labels.org.arl-tangram.env", 400)):
            with pytest.raises(TangramHTTPError) as e:
                await c.create_environment(**kw)
            assert (e.value.status, e.value.field) == (status, field)
        assert svc.runtime.environments() == []
