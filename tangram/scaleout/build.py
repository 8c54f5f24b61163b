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

from tangram.core.errors import ConfigError
from tangram.scaleout.config import DockerNodeOptions, ScaleoutConfig, parse_scaleout


class Scaleout:
    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.options: ScaleoutConfig = parse_scaleout(getattr(cfg, "scaleout", None))
        self.probes: dict[str, Any] = {}
        self.hosts: Any = None
        self.initially_down: dict[str, str] = {}
        self._closers: list[Any] = []

    @property
    def gpu_host(self):
        return self.options.gpu_host

    def _docker(self, name: str) -> DockerNodeOptions:
        return self.options.docker_nodes.get(name, DockerNodeOptions())

    async def cpu_node(self, n: Any) -> Any:
        """A docker node's CpuNode: the config's cores/memory/NUMA, the rest discovered from its engine.

        An engine that does not answer is fine when the config gives cores and
        memory: the node starts marked down and joins when it answers.
        """
        import asyncio

        from tangram.managers.cpu import CpuNode
        from tangram.scaleout.docker_nodes import DockerPing, NotOnEngine, discover, make_client

        o = self._docker(n.name)
        self.probes[n.name] = DockerPing(n.endpoint, tls=o.tls, timeout_s=self.options.health_timeout_s)

        def find() -> Any:
            client = make_client(n.endpoint, tls=o.tls, timeout=30.0)
            try:
                return discover(client, n.name, cores=list(n.cores) or None, memory_mb=n.memory_mb or None,
                                numa=[list(g) for g in n.numa] or None, image=n.image, probe=o.probe)
            finally:
                client.close()

        i = next(k for k, c in enumerate(self.cfg.cpu_nodes) if c.name == n.name)
        try:
            return await asyncio.to_thread(find)
        except NotOnEngine as exc:
            raise ConfigError(f"cpu_nodes[{i}].{exc.field}", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - unreachable, refused, TLS: all mean "not answering"
            why = f"unreachable at start: {type(exc).__name__}: {str(exc)[:200]}"
            if not n.cores or not n.memory_mb:
                raise ConfigError(f"cpu_nodes[{i}].endpoint", f"{n.endpoint}: {why}; its topology cannot be "
                                  f"discovered (give cores and memory_mb to start without it)") from None
            self.initially_down[n.name] = why
            return CpuNode(name=n.name, cores=tuple(n.cores), memory_mb=n.memory_mb,
                           numa=tuple(tuple(g) for g in n.numa) or None)

    def env_executor(self, n: Any) -> Any:
        from tangram.executors.docker import DockerExecutor
        from tangram.executors.docker_image import SANDBOX_IMAGE
        from tangram.scaleout.docker_nodes import LazyClient, make_client

        o = self._docker(n.name)
        client = LazyClient(lambda: make_client(n.endpoint, tls=o.tls, timeout=120.0))
        self._closers.append(_closer(client))
        return DockerExecutor(client, image=n.image or SANDBOX_IMAGE, allowed_images=n.allowed_images())

    async def build_gpu(self, nodes: Sequence[Any]) -> tuple[Any, dict[str, Any], set[str]]:
        from tangram.scaleout.ray_gpu import GpuHosts, build_remote_gpu

        self.hosts = GpuHosts(self.gpu_host)
        self._closers.append(self.hosts.close)  # before any actor starts: a build failing among them kills them
        # on the loop's thread: ray.init wants the main thread; actor creation itself does not block
        manager, runners, models = build_remote_gpu(nodes, self.hosts)
        if self.gpu_host.address is not None:  # in-process hosts cannot die apart from us
            for name, r in runners.items():
                self.probes[name] = r.host.handle.ping
        return manager, runners, models

    async def close(self) -> None:
        """What a build that failed before its runtime existed had started (the runtime closes it otherwise)."""
        for close in reversed(self._closers):
            await close()

    def runtime(self, managers: list[Any], *, params: Any, keep_results: int, **kw: Any) -> Any:
        from tangram.core.engine import Engine
        from tangram.scaleout.cluster import ClusterRuntime
        from tangram.scaleout.gate import DownNodes, gate_all

        down = DownNodes()
        # finished records no longer than the runtime keeps their results (service.keep_results)
        engine = Engine(gate_all(managers, down), params=params, keep_finished=keep_results)
        rt = ClusterRuntime(engine, down=down, give_up_s=self.options.give_up_s, keep_results=keep_results,
                            closers=[*kw.pop("closers", ()), *self._closers], **kw)
        o = self.options
        rt.start_health(self.probes, interval_s=o.health_interval_s, timeout_s=o.health_timeout_s,
                        failures=o.health_failures)
        for node, why in self.initially_down.items():
            rt.node_down(node, why)  # the health loop adds it when it answers
        return rt


def wanted(cfg: Any) -> bool:
    """Whether the config asks for scale-out (a scaleout section or a docker node)."""
    return getattr(cfg, "scaleout", None) is not None or any(n.executor == "docker" for n in cfg.cpu_nodes)


def _closer(client: Any):
    async def close() -> None:
        client.close()  # after the executor removed its containers (closers run last)
    return close
