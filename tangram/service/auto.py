"""``executor: auto``: this machine's Docker Engine as the CPU node when one answers, else the
local sandbox (a working directory per environment). Decided once, at start."""
from __future__ import annotations

import dataclasses
import logging

from tangram.service.config import ClusterConfig, CpuNodeConfig

log = logging.getLogger("tangram.service")


def docker_answers(endpoint: str, timeout_s: float = 3.0) -> str | None:
    """``None`` when the engine at ``endpoint`` answers a ping, else why not (blocking)."""
    try:
        import docker
    except ImportError as exc:
        return f"the docker SDK is not installed ({exc}; pip install '.[docker]')"
    try:
        client = docker.DockerClient(base_url=endpoint, timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - refused, missing socket, permission: all mean "no engine"
        return f"no Docker Engine answers at {endpoint} ({type(exc).__name__}: {str(exc)[:160]})"
    return None


def resolve_auto(cfg: ClusterConfig, answers=docker_answers) -> ClusterConfig:
    """``cfg`` with every ``auto`` CPU node made ``docker`` or ``local`` (blocking: a ping each)."""
    if not any(n.executor == "auto" for n in cfg.cpu_nodes):
        return cfg
    nodes = []
    for n in cfg.cpu_nodes:
        if n.executor == "auto":
            why_not = answers(n.endpoint)
            if why_not is None:
                log.info("cpu node %s: Docker Engine at %s answers; environments are containers", n.name, n.endpoint)
                n = dataclasses.replace(n, executor="docker")
            else:
                log.info("cpu node %s: %s; environments are local working directories", n.name, why_not)
                n = dataclasses.replace(n, executor="local", endpoint=None)
        nodes.append(n)
    return dataclasses.replace(cfg, cpu_nodes=tuple(nodes))
