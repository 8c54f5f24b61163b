"""The scale-out half of :func:`tangram.service.build.build_runtime` (hooked there).

Used when the config has a ``scaleout:`` section or any docker CPU node:
docker nodes get a client of their endpoint (TLS / ssh), their topology is
discovered where the config leaves it out, GPU nodes run on
:mod:`.ray_gpu` hosts when ``scaleout.gpu_host`` is set, every manager is
wrapped in a :class:`~.gate.NodeGate`, and the runtime is a
:class:`~.cluster.ClusterRuntime` whose health loop pings each docker
endpoint and each Ray GPU host.
"""
from __future__ import annotations

from typing import Any, Sequence

from tangram.scaleout.config import DockerNodeOptions, ScaleoutConfig, parse_scaleout


class Scaleout:
    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.options: ScaleoutConfig = parse_scaleout(getattr(cfg, "scaleout", None))
        self.probes: dict[str, Any] = {}
        self.hosts: Any = None
        self._closers: list[Any] = []

    @property
    def gpu_host(self):
        return self.options.gpu_host

    def _docker(self, name: str) -> DockerNodeOptions:
        return self.options.docker_nodes.get(name, DockerNodeOptions())

    async def cpu_node(self, n: Any) -> Any:
        """A docker node's CpuNode: the config's cores/memory/NUMA, the rest discovered from its engine."""
        from tangram.scaleout.docker_nodes import DockerPing, discover_async, make_client

        o = self._docker(n.name)
        client = make_client(n.endpoint, tls=o.tls, timeout=60.0)
        try:
            node = await discover_async(client, n.name, cores=list(n.cores) or None, memory_mb=n.memory_mb or None,
                                        numa=[list(g) for g in n.numa] or None, image=n.image, probe=o.probe)
        finally:
            client.close()
        self.probes[n.name] = DockerPing(n.endpoint, tls=o.tls, timeout_s=self.options.health_timeout_s)
        return node

    def env_executor(self, n: Any) -> Any:
        from tangram.executors.docker import DockerExecutor
        from tangram.executors.docker_image import SANDBOX_IMAGE
        from tangram.scaleout.docker_nodes import make_client

        o = self._docker(n.name)
        return DockerExecutor(make_client(n.endpoint, tls=o.tls, timeout=120.0), image=n.image or SANDBOX_IMAGE)

    async def build_gpu(self, nodes: Sequence[Any]) -> tuple[Any, dict[str, Any], set[str]]:
        from tangram.scaleout.ray_gpu import GpuHosts, build_remote_gpu

        self.hosts = GpuHosts(self.gpu_host)
        # on the loop's thread: ray.init wants the main thread; actor creation itself does not block
        manager, runners, models = build_remote_gpu(nodes, self.hosts)
        if self.gpu_host.address is not None:  # in-process hosts cannot die apart from us
            for name, r in runners.items():
                self.probes[name] = r.handle.ping
        self._closers.append(self.hosts.close)
        return manager, runners, models

    def runtime(self, managers: list[Any], *, params: Any, **kw: Any) -> Any:
        from tangram.core.engine import Engine
        from tangram.scaleout.cluster import ClusterRuntime
        from tangram.scaleout.gate import DownNodes, gate_all

        down = DownNodes()
        engine = Engine(gate_all(managers, down), params=params)
        rt = ClusterRuntime(engine, down=down, closers=[*kw.pop("closers", ()), *self._closers], **kw)
        o = self.options
        rt.start_health(self.probes, interval_s=o.health_interval_s, timeout_s=o.health_timeout_s,
                        failures=o.health_failures)
        return rt


def wanted(cfg: Any) -> bool:
    """Whether the config asks for scale-out (a scaleout section or a docker node)."""
    return getattr(cfg, "scaleout", None) is not None or any(n.executor == "docker" for n in cfg.cpu_nodes)
