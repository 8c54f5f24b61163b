"""The ``scaleout:`` section of the cluster config (validated here, kept raw by tangram.service.config).

.. code-block:: yaml

    scaleout:
      health: {interval_s: 1.0, timeout_s: 2.0, failures: 2,   # node health loop
               give_up_s: 300}  # a Docker node's environments wait this long for it, then are lost
      docker_nodes:            # per docker cpu node (by name): how to reach and probe it
        node1:
          tls: {ca_cert: /certs/ca.pem, client_cert: /certs/cert.pem, client_key: /certs/key.pem}
          probe: true          # run the topology probe container (else `docker info` only)
      gpu_host:                # GPU nodes as simulated hosts: Ray actors, or in-process without `address`
        address: auto          # or ray://head:10001; omit for in-process
        namespace: tangram
        resource: GPU          # or a custom resource standing in for GPUs (tangram_gpu)
        simulated: {restore_gbps: 20.0, batch_latency_s: 0.05}
        executor: simulated    # or torch: the services' options.factory / options.hf_path, run by torch

Docker CPU nodes may omit ``cores`` and ``memory_mb``: they are discovered
from the engine (``docker info`` + the probe container).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from tangram.core.errors import ConfigError
from tangram.core.fields import Fields
from tangram.scaleout.docker_nodes import DockerTls
from tangram.scaleout.ray_gpu import GpuHostConfig

_SIM_FIELDS = {"restore_gbps", "restore_overhead_s", "batch_latency_s", "batch_size"}


@dataclass(frozen=True, slots=True)
class DockerNodeOptions:
    tls: DockerTls | None = None
    probe: bool = True


@dataclass(frozen=True, slots=True)
class ScaleoutConfig:
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    health_failures: int = 2
    give_up_s: float = 300.0  # suspended environments of a down node (Docker) are lost after this
    docker_nodes: Mapping[str, DockerNodeOptions] = field(default_factory=dict)
    gpu_host: GpuHostConfig | None = None  # None: GPU nodes use the in-process torch executor (build_gpu)


def parse_scaleout(raw: Any, where: str = "scaleout") -> ScaleoutConfig:
    if raw is None:
        return ScaleoutConfig()
    m = _mapping(raw, where)
    _known(m, where, {"health", "docker_nodes", "gpu_host"})
    h = _mapping(m.get("health", {}), f"{where}.health")
    _known(h, f"{where}.health", {"interval_s", "timeout_s", "failures", "give_up_s"})
    give_up = _pos(h.get("give_up_s", 300.0), f"{where}.health.give_up_s")
    interval = _pos(h.get("interval_s", 1.0), f"{where}.health.interval_s")
    timeout = _pos(h.get("timeout_s", 2.0), f"{where}.health.timeout_s")
    failures = h.get("failures", 2)
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
        raise ConfigError(f"{where}.health.failures", f"must be an integer >= 1, got {failures!r}")
    docker: dict[str, DockerNodeOptions] = {}
    for name, opts in _mapping(m.get("docker_nodes", {}), f"{where}.docker_nodes").items():
        w = f"{where}.docker_nodes.{name}"
        o = _mapping(opts or {}, w)
        _known(o, w, {"tls", "probe"})
        try:
            tls = DockerTls.from_mapping(_mapping(o["tls"], f"{w}.tls")) if o.get("tls") else None
        except ValueError as exc:
            raise ConfigError(f"{w}.tls", str(exc)) from None
        probe = o.get("probe", True)
        if not isinstance(probe, bool):
            raise ConfigError(f"{w}.probe", f"must be true or false, got {probe!r}")
        docker[str(name)] = DockerNodeOptions(tls=tls, probe=probe)
    gpu_host = None
    if m.get("gpu_host") is not None:
        w = f"{where}.gpu_host"
        g = _mapping(m["gpu_host"], w)
        _known(g, w, {"address", "namespace", "resource", "simulated", "executor"})
        executor = g.get("executor", "simulated")
        if executor not in ("simulated", "torch"):
            raise ConfigError(f"{w}.executor", f"must be 'simulated' or 'torch', got {executor!r}")
        address = g.get("address")
        if address is not None and (not isinstance(address, str) or not address):
            raise ConfigError(f"{w}.address", f"must be 'auto', 'ray://host:port' or 'host:port', got {address!r}")
        sim = dict(_mapping(g.get("simulated", {}), f"{w}.simulated"))
        _known(sim, f"{w}.simulated", _SIM_FIELDS)
        gpu_host = GpuHostConfig(address=address, namespace=str(g.get("namespace", "tangram")),
                                 resource=str(g.get("resource", "GPU")), sim=sim, executor=executor)
    return ScaleoutConfig(interval, timeout, failures, give_up, docker, gpu_host)


_FIELDS = Fields(ConfigError)
_mapping, _known, _pos = _FIELDS.mapping, _FIELDS.known, _FIELDS.positive
