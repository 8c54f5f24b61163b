"""An ``executor: auto`` node is checked as what it resolved to: a network where it became a local node
that allows one, a Docker node's allowed images at the request (never a 201 for an image it refuses)."""
from __future__ import annotations

import aiohttp
import pytest

from tests.service_helpers import config, running_service

pytestmark = pytest.mark.timeout(120)


async def test_an_auto_node_that_became_local_gives_the_network_it_allows(tmp_path):
    cfg = config(cpu_nodes=[{"name": "n", "executor": "auto", "endpoint": f"unix://{tmp_path}/no-engine.sock",
                             "cores": 1, "memory_mb": 1024, "allow_network": True}])
    async with running_service(cfg) as svc:
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"{svc.url}/v1/environments", json={"network": True})
            assert r.status == 201, await r.text()
            env = (await r.json())["id"]
            assert (await s.delete(f"{svc.url}/v1/environments/{env}")).status == 204


async def test_an_auto_node_that_became_docker_refuses_an_image_at_the_request(docker_client):
    cfg = config(cpu_nodes=[{"name": "n", "executor": "auto", "cores": 1, "memory_mb": 1024}])
    async with running_service(cfg) as svc:
        assert svc.runtime.env_executors["n"].name.startswith("docker")  # resolved so
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"{svc.url}/v1/environments", json={"image": "not-allowed:latest"})
            assert r.status == 422
            assert (await r.json())["field"] == "image"
            assert (await s.get(f"{svc.url}/v1/environments")).status == 200
            assert (await (await s.get(f"{svc.url}/v1/environments")).json())["environments"] == []
