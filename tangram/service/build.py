"""Build a :class:`~tangram.runtime.Runtime` from a :class:`ClusterConfig`.

The one place that knows which manager and executor serve which part of the
config; executors (docker SDK, torch) are imported only when the config
names them, so a CPU-only local service never loads them.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Awaitable, Callable

from tangram.core.engine import Engine
from tangram.policy.compiled import PURE_ENV, native_modules, walk_module
from tangram.policy.snapshot import PolicyParams
from tangram.profiles import load_profiles
from tangram.runtime import Runtime
from tangram.runtime.environments import quietly
from tangram.service.config import ClusterConfig, ConfigError, CpuNodeConfig, warm_start_on
from tangram.service.sandbox_protocol import toolchain_paths

log = logging.getLogger("tangram.service")


async def build_runtime(cfg: ClusterConfig) -> Runtime:
    """Managers, executors and the engine of ``cfg`` (call on the loop that will drive it). A build that
    fails part way (a model's factory that does not import, a docker node refused) closes what it had
    made, executors and GPU hosts: a failed start leaks no environment root, cgroup or actor."""
    made: list[Callable[[], Awaitable[Any]]] = []  # the closes of what the build made so far
    try:
        return await _build(cfg, made)
    except BaseException:
        for close in reversed(made):
            await quietly(close(), "closing what a failed start had made")
        raise


async def _build(cfg: ClusterConfig, made: list[Callable[[], Awaitable[Any]]]) -> Runtime:
    import asyncio

    from tangram.service.auto import resolve_auto

    cfg = await asyncio.to_thread(resolve_auto, cfg)
    profiles: dict[str, Any] = {}
    for i, path in enumerate(cfg.profiles):
        try:
            profiles.update(load_profiles(path))
        except ValueError as exc:
            raise ConfigError(f"profiles[{i}]", str(exc)) from None
    managers: list[Any] = []
    env_executors: dict[str, Any] = {}
    # scale-out hook (tangram/scaleout/build.py): docker endpoints with discovered topology,
    # GPU nodes on Ray actors, node gates and a health loop; None leaves this function as it was
    scale = None
    from tangram.scaleout.build import wanted

    if wanted(cfg):
        from tangram.scaleout.build import Scaleout

        scale = Scaleout(cfg)
        made.append(scale.close)
    if cfg.cpu_nodes:
        from tangram.managers.cpu import CpuManager

        docker = scale is not None
        nodes = [await scale.cpu_node(n) if docker and n.executor == "docker" else _cpu_node(n)
                 for n in cfg.cpu_nodes]
        managers.append(CpuManager(nodes))
        for i, n in enumerate(cfg.cpu_nodes):
            env_executors[n.name] = (scale.env_executor(n) if docker and n.executor == "docker"
                                     else _env_executor(n, f"cpu_nodes[{i}]",
                                                        toolchains=toolchain_paths(cfg.sandbox_fusion)))
            made.append(env_executors[n.name].close)
    model_executors: dict[str, Any] | None = None
    models: set[str] | None = None
    if cfg.gpu_nodes and scale is not None and scale.gpu_host is not None:
        gpu_manager, model_executors, models = await scale.build_gpu(cfg.gpu_nodes)
        managers.append(gpu_manager)
    elif cfg.gpu_nodes:
        from tangram.service.build_gpu import build_gpu

        gpu_manager, model_executors, models = build_gpu(cfg.gpu_nodes)
        managers.append(gpu_manager)
        made.extend(r.close for r in model_executors.values())
    http_executor = None
    if cfg.api_pools:
        from tangram.executors.http import HttpExecutor
        from tangram.managers.basic import ApiLimit, BasicManager

        managers.append(BasicManager({
            p.name: ApiLimit(concurrency=p.concurrency, quota=p.quota, period_s=p.period_s, window=p.window,
                             arrival_margin_s=p.arrival_margin_s, books=p.books)
            for p in cfg.api_pools
        }))
        http_executor = HttpExecutor()
    params = PolicyParams(depth=cfg.depth, lookahead=cfg.lookahead, default_duration_s=cfg.default_duration_s,
                          dop_caps=dict(cfg.dop_caps), order=cfg.order, aging_k=cfg.aging_k,
                          aging_cap_s=cfg.aging_cap_s, progress_s=cfg.progress_s,
                          generation_credit=cfg.generation_credit,
                          affinity_k=cfg.affinity_k, expect_arrivals=cfg.expect_arrivals, arrival_gap=cfg.arrival_gap,
                          learn_unprofiled=cfg.learn_unprofiled, restart_gain=cfg.restart_gain,
                          offered_load_caps=dict(cfg.offered_load_caps))
    # why the policy runs as plain Python, below: asked for, or an install that could not compile it
    advice = (f"{PURE_ENV}=1 asks for it" if os.environ.get(PURE_ENV) == "1"
              else "reinstall with a C compiler at hand (pip install -e .)")
    hot = walk_module()
    if not hot.COMPILED:  # the install could not build it (pip hides the build's warning) or was told not to
        log.warning("the ACT estimate runs as plain Python (%s): rounds with long look-aheads are slower; %s",
                    hot.__file__, advice)
    as_source = sorted(name for name, yes in native_modules().items() if not yes)
    if as_source:  # the same: the modules of a round compiled whole (tangram/policy/compiled.py)
        log.warning("the policy's modules %s run as plain Python: rounds are ~1.2x slower; %s", ", ".join(as_source),
                    advice)
    if scale is not None:  # scale-out hook: gated managers, ClusterRuntime with its health loop
        rt = scale.runtime(managers, params=params, env_executors=env_executors, http_executor=http_executor,
                           model_executors=model_executors, models=models, profiles=profiles,
                           keep_results=cfg.service.keep_results)
    else:
        # the engine's finished records hold the actions (payloads) too: kept no longer than their results
        engine = Engine(managers, params=params, keep_finished=cfg.service.keep_results)
        rt = Runtime(engine, env_executors=env_executors, http_executor=http_executor,
                     model_executors=model_executors, models=models, profiles=profiles,
                     keep_results=cfg.service.keep_results)
    made[:] = [rt.close]  # the runtime closes all it was given
    # scale-out: a host picks its own devices, the head's CUDA says nothing of them (its `device` field decides)
    probe = scale is None and any(n.warm_start is None and n.device is None for n in cfg.gpu_nodes)
    cuda_visible = _cuda_visible() if probe else False
    for n in cfg.gpu_nodes:  # each runner's task ends with its close, as the runtime closes
        if warm_start_on(n, cuda_visible):  # scale-out: the node's down signal ends its warm start too
            signals = getattr(rt, "signals", None)
            model_executors[n.name].start_warm(
                rt.tick, down=None if signals is None else (lambda node=n.name: signals.event(node)))
    return rt


def _cuda_visible() -> bool:
    """CUDA seen from this process, where a node with no ``device`` runs its models."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch on a scale-out head, or a broken CUDA install: no warm start
        return False


def _cpu_node(n: CpuNodeConfig):
    from tangram.managers.cpu import CpuNode, discover_local_node

    numa = [list(g) for g in n.numa] or None
    if n.executor == "local" and numa is None:
        # the machine's NUMA domains, restricted to the cores this node may use
        found = discover_local_node(n.name, memory_mb=n.memory_mb)
        keep = set(n.cores)
        numa = [[c for c in d if c in keep] for d in found.numa or ()]
        numa = [d for d in numa if d]
        covered = {c for d in numa for c in d}
        rest = [c for c in n.cores if c not in covered]
        if rest:
            numa.append(rest)
    return CpuNode(name=n.name, cores=tuple(n.cores), numa=tuple(tuple(d) for d in numa) if numa else None,
                   memory_mb=n.memory_mb)


def _env_executor(n: CpuNodeConfig, where: str = "cpu_nodes[0]", toolchains: tuple[str, ...] = ()) -> Any:
    if n.executor == "local":
        from tangram.executors.local import LocalExecutor, SandboxUnavailable

        if n.isolation == "none":
            log.warning("node %r: isolation none - commands run unsandboxed as this service's user, with its "
                        "files, network and secrets in reach; only for trusted code", n.name)
        try:
            # the node's own read-only paths and the toolchains of the SandboxFusion endpoint's languages
            readonly = tuple(dict.fromkeys(n.readonly + toolchains))
            return LocalExecutor(root=n.workdir, sandbox=n.isolation, allow_network=n.allow_network,
                                 readonly=readonly)
        except SandboxUnavailable as exc:
            raise ConfigError(f"{where}.isolation", f"{exc}; to run commands unsandboxed (trusted code only), "
                                                    "set isolation: none on this node") from None
    from tangram.executors.docker import DockerExecutor

    kw = {"image": n.image} if n.image else {}
    return DockerExecutor(base_url=n.endpoint, allowed_images=n.allowed_images(), **kw)
