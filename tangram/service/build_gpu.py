"""GPU nodes in this process: the EOE manager and a torch executor per node, joined by :class:`GpuRunner`.

A service's ``options`` say how to build its model (registered with
:func:`tangram.executors.torch_gpu.register_model`):

* ``factory: "package.module:callable"`` returning an ``nn.Module`` or a ``ServedModel``;
* ``hf_path: /models/reward`` (+ ``causal_lm: true``): a Hugging Face directory, offline;
* neither: the model must already be registered in this process.

torch is imported only here, and only when the config has GPU nodes.
"""
from __future__ import annotations

import importlib
from typing import Any, Mapping, Sequence

from tangram.core.errors import ConfigError
from tangram.runtime.gpu import GpuRunner
from tangram.service.config import GpuNodeConfig

_CPU_DEVICE_MB = 16_384  # virtual devices (CPU tests): a nominal per-device memory


def build_gpu(nodes: Sequence[GpuNodeConfig]) -> tuple[Any, dict[str, GpuRunner], set[str]]:
    """The GpuManager, a runner per node, and the names of the servable models."""
    from tangram.executors.torch_gpu import TorchGpuExecutor, device_facts, registered_models
    from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec

    executors: dict[str, Any] = {}
    specs: dict[str, ModelSpec] = {}
    gnodes = []
    for i, n in enumerate(nodes):
        where = f"gpu_nodes[{i}]"
        devices = _devices(n)
        ex = TorchGpuExecutor(devices=devices)
        executors[n.name] = ex
        mem = n.memory_mb_per_gpu
        if mem is None:
            facts = device_facts(devices) if devices and devices[0] != "cpu" else []
            mem = min((int(f.get("memory_mb") or 0) for f in facts), default=0) or _CPU_DEVICE_MB
        gnodes.append(GpuNode(name=n.name, num_gpus=len(n.gpus), memory_mb_per_gpu=mem))
        for j, s in enumerate(n.services):
            _register(s.name, s.options, f"{where}.services[{j}].options")
            state_mb = s.state_mb or _measured_state_mb(ex, s.name, f"{where}.services[{j}]")
            specs.setdefault(s.name, ModelSpec(name=s.name, state_mb=state_mb, sharded=s.sharded,
                                               overhead_mb=s.overhead_mb))
    manager = GpuManager(gnodes, specs.values())
    runners = {n.name: GpuRunner(manager, executors[n.name], f"gpu@{n.name}") for n in nodes}
    known = set(specs) or set(registered_models())
    return manager, runners, known


def _devices(n: GpuNodeConfig) -> list[str]:
    import torch

    use_cuda = n.device == "cuda" or (n.device is None and torch.cuda.is_available())
    return [f"cuda:{g}" for g in n.gpus] if use_cuda else ["cpu"] * len(n.gpus)


def _register(name: str, options: Mapping[str, Any], where: str) -> None:
    from tangram.executors.torch_gpu import hf_factory, register_model, registered_models

    if "factory" in options:
        ref = str(options["factory"])
        mod, _, attr = ref.partition(":")
        try:
            factory = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"{where}.factory", f"cannot import {ref!r}: {exc}") from None
        register_model(name, factory)
    elif "hf_path" in options:
        register_model(name, hf_factory(str(options["hf_path"]), causal_lm=bool(options.get("causal_lm", False))))
    elif name not in registered_models():
        raise ConfigError(where, f"model {name!r} is not registered: give options.factory or options.hf_path")


def _measured_state_mb(executor: Any, name: str, where: str) -> int:
    try:
        return int(executor.state_mb(name))
    except Exception as exc:  # noqa: BLE001 - a model that cannot load is a config error
        raise ConfigError(f"{where}.state_mb", f"not given and the model could not be loaded: {exc}") from None
