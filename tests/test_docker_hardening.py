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
