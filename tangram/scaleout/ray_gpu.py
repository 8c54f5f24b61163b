"""GPU nodes as Ray actors (DESIGN.md §7): one actor per GPU node, holding that node's service cache.

Split of the EOE work: the control plane keeps the *books* (the
:class:`~tangram.managers.gpu.GpuManager`: buddy chunks, which service is
resident where, LRU), because the policy reads them every round; the node
holds the *state* (:class:`GpuNodeHost`: the resident services in device
memory, the restores and evictions, the model runs). Each action ships the
manager's :class:`~tangram.managers.service_cache.CacheDecision` to its
node's host, which carries it out and reports whether it restored.

The host runs the simulated GPU executor (memory capacity, restore
bandwidth, batch latency; no torch needed), so a cluster can be exercised
on machines without GPUs, or ``executor: torch``: the real
:class:`~tangram.executors.torch_gpu.TorchGpuExecutor` with the models of
the node's services (``options.factory: "module:callable"`` or
``options.hf_path``) registered inside the host (CUDA devices when Ray gave
the actor GPUs, virtual CPU devices otherwise). It runs

* as a Ray actor (``num_gpus`` = the node's GPUs, or a custom resource
  standing in for GPUs, e.g. ``{"tangram_gpu": 4}``; placed by Ray), on an
  existing cluster (``address: auto`` or ``ray://head:10001``), with
  ``max_restarts=-1``: when its Ray node dies, Ray restarts it wherever the
  resources reappear (the node returns), fresh and empty;
* or in this process when no cluster is configured (no Ray import at all).

A host restarted empty may be told "hit" for a service its books still
think resident; it then restores it (self-healing; the books are only ever
more conservative than the devices, so this never overflows memory).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from tangram.core.grants import CacheDecision, parse_service
from tangram.executors.base import FAILED, SUCCEEDED, TIMEOUT, ExecResult
from tangram.managers.service_cache import ModelSpec
from tangram.runtime.gpu import GpuRunner

log = logging.getLogger("tangram.scaleout.ray")

ACTOR_PREFIX = "tangram-gpu-"


class GpuNodeHost:
    """One GPU node's executing side: resident services, restores, evictions, runs."""

    def __init__(self, node: str, num_gpus: int, memory_mb_per_gpu: int, models: Sequence[ModelSpec] = (),
                 sim: Mapping[str, Any] | None = None, *, executor: str = "simulated",
                 model_options: Mapping[str, Mapping[str, Any]] | None = None):
        self.node = node
        self.models = {m.name: m for m in models}
        self.executor = executor
        self.started_at = time.time()
        self.runs = 0
        self.sim: Any = None
        self.torch: Any = None
        if executor == "torch":
            self.torch = _torch_executor(num_gpus, model_options or {})
        elif executor == "simulated":
            from tangram.executors.simulated_gpu import SimGpuParams, SimulatedGpuExecutor

            self.sim = SimulatedGpuExecutor(num_gpus, SimGpuParams(memory_mb_per_gpu=memory_mb_per_gpu,
                                                                   **dict(sim or {})))
        else:
            raise ValueError(f"executor: 'simulated' or 'torch', got {executor!r}")

    async def ping(self) -> dict[str, Any]:
        resident = self.sim.resident() if self.sim is not None else self.torch.resident()
        return {"node": self.node, "where": _where(), "resident": resident, "runs": self.runs,
                "started_at": self.started_at, "executor": self.executor}

    async def execute(self, decision: CacheDecision, payload: Mapping[str, Any]) -> dict[str, Any]:
        if self.torch is not None:
            return await self._execute_torch(decision, payload)
        d = decision
        healed = False
        if d.service is not None and d.hit and (d.service, d.chunk.start) not in self.sim.resident():
            # this host restarted empty (its node came back) while the books kept the service: restore it
            model, dop = parse_service(d.service)
            spec = self.models.get(model)
            d = dataclasses.replace(d, hit=False, evict=(),
                                    restore_mb_per_device=spec.mb_per_device(dop) if spec else 0)
            healed = True
        inputs = payload.get("inputs")
        n = len(inputs) if isinstance(inputs, (list, tuple)) else 1
        exec_s = payload.get("exec_s")
        t = await self.sim.execute(d, n, exec_s=float(exec_s) if isinstance(exec_s, (int, float)) else None)
        self.runs += 1
        facts = {"node": self.node, "where": _where(), "service": d.service, "hit": t.hit, "healed": healed,
                 "restored": (not decision.hit) and d.service is not None, "restore_s": t.restore_s,
                 "exec_s": t.exec_s, "evicted": list(t.evicted), "n": n}
        return {**facts, "status": SUCCEEDED, "output": facts}

    async def _execute_torch(self, decision: CacheDecision, payload: Mapping[str, Any]) -> dict[str, Any]:
        # the torch executor restores a "hit" this (restarted) process lost by itself
        res = await self.torch.execute(decision, {k: v for k, v in payload.items() if k != "exec_s"})
        self.runs += 1
        return {"node": self.node, "where": _where(), "service": decision.service, "status": res.status,
                "error": res.error, "output": res.output, "hit": decision.hit and not res.restore_s,
                "restored": res.restored and not decision.hit, "restore_s": res.restore_s,
                "exec_s": res.exec_s or 0.0, "details": dict(res.details)}


def _torch_executor(num_gpus: int, model_options: Mapping[str, Mapping[str, Any]]) -> Any:
    """The torch executor of a host, its models registered in this process (a Ray worker or ours)."""
    import importlib

    from tangram.executors.torch_gpu import TorchGpuExecutor, _torch, hf_factory, register_model

    for name, opts in model_options.items():
        if "factory" in opts:
            mod, _, attr = str(opts["factory"]).partition(":")
            register_model(name, getattr(importlib.import_module(mod), attr))
        elif "hf_path" in opts:
            register_model(name, hf_factory(str(opts["hf_path"])))
    torch = _torch()
    # Ray exposes the actor's GPUs as cuda:0..n-1; a custom resource standing in for GPUs gets CPU devices
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= num_gpus
    return TorchGpuExecutor([f"cuda:{i}" for i in range(num_gpus)] if cuda else ["cpu"] * num_gpus)


def _where() -> str:
    """The Ray node id this runs on (or ``local``)."""
    try:
        ray = sys.modules.get("ray")  # never import ray just to ask (in-process hosts run without it)
        if ray is not None and ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        pass
    return "local"


# ---------------------------------------------------------------------- #
# handles: the same calls on an in-process host or a Ray actor


class LocalHandle:
    def __init__(self, host: GpuNodeHost):
        self.host = host

    async def call(self, method: str, *args: Any, unsettled: Callable[[asyncio.Future], None] | None = None) -> Any:
        return await getattr(self.host, method)(*args)  # in-process: a cancel reaches the host's own coroutine

    async def ping(self) -> None:
        await self.host.ping()

    def kill(self) -> None:
        pass


_CANCEL_SETTLE_S = 10.0


async def _settled(ref: Any) -> None:
    try:
        await ref
    except BaseException:  # noqa: BLE001 - cancelled or failed: either way it has stopped
        pass


class RayHandle:
    def __init__(self, actor: Any, name: str):
        self.actor = actor
        self.name = name

    async def call(self, method: str, *args: Any, unsettled: Callable[[asyncio.Future], None] | None = None) -> Any:
        """``method`` on the host; on a cancel, the host's call is cancelled too, handed at once to
        ``unsettled`` as a future that ends when the host has stopped it (the runner keeps the chunk until
        then, whenever it looks: a caller cancelled again stops waiting here), and this waits for that,
        at most ``_CANCEL_SETTLE_S``."""
        import ray

        ref = getattr(self.actor, method).remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)  # the host's coroutine is cancelled too: a half restore is undone there
            settle = asyncio.ensure_future(_settled(ref))
            if unsettled is not None:
                unsettled(settle)
            try:
                await asyncio.wait({settle}, timeout=_CANCEL_SETTLE_S)
            except asyncio.CancelledError:
                pass
            if not settle.done() and unsettled is None:
                settle.cancel()  # nobody waits for it
            raise

    async def ping(self) -> None:
        # not through call(): a ping has nothing to undo on the host, so on timeout its ref is
        # abandoned at once; waiting _CANCEL_SETTLE_S on a hung host would stall every health round
        await self.actor.ping.remote()

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


# ---------------------------------------------------------------------- #
# the host as the runtime's GpuRunner sees it


class RemoteHost:
    """The :class:`~tangram.runtime.gpu.ModelHost` of one node whose host runs elsewhere (or in-process)."""

    def __init__(self, handle: LocalHandle | RayHandle, node: str):
        self.handle = handle
        self.node = node
        self._stopping: dict[str, asyncio.Future] = {}  # holder -> its cancelled call, still running there

    def stopping(self, holder: str) -> asyncio.Future | None:
        """The call of ``holder`` that was cancelled (or timed out) and has not stopped on the host yet."""
        return self._stopping.get(holder)

    def _unsettled(self, holder: str, fut: asyncio.Future) -> None:
        self._stopping[holder] = fut

        def stopped(f: asyncio.Future) -> None:
            if self._stopping.get(holder) is f:  # not a later call of the same holder's
                del self._stopping[holder]

        fut.add_done_callback(stopped)

    async def execute(self, decision: CacheDecision, payload: Mapping[str, Any], *,
                      timeout_s: float | None = None) -> ExecResult:
        keep = functools.partial(self._unsettled, decision.holder)
        try:
            res = await asyncio.wait_for(self.handle.call("execute", decision, payload, unsettled=keep), timeout_s)
        except asyncio.TimeoutError:
            return ExecResult(status=TIMEOUT, error=f"no result within {timeout_s:g} s")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead actor / node: the guard usually answers first
            if _is_ray_death(exc):
                return ExecResult(status=FAILED, error=f"node {self.node!r} is down: {type(exc).__name__}",
                                  node_down=True)
            raise
        return ExecResult(status=res.get("status", SUCCEEDED), output=res.get("output"), error=res.get("error"),
                          exec_s=float(res.get("exec_s") or 0.0), restored=bool(res.get("restored")),
                          restore_s=float(res.get("restore_s") or 0.0), details={"where": res.get("where")})


def _is_ray_death(exc: BaseException) -> bool:
    return type(exc).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError",
                                  "NodeDiedError", "WorkerCrashedError", "ActorUnschedulableError")


# ---------------------------------------------------------------------- #
# building the hosts


@dataclass(frozen=True, slots=True)
class GpuHostConfig:
    """Where GPU node hosts run. ``address`` None: in this process, without Ray."""

    address: str | None = None  # "auto", "ray://head:10001", "host:6379"
    namespace: str = "tangram"
    resource: str = "GPU"  # "GPU" -> num_gpus; anything else is a custom resource
    executor: str = "simulated"  # or "torch" (models from the services' options)
    sim: Mapping[str, Any] = field(default_factory=dict)  # SimGpuParams fields but memory_mb_per_gpu
    init_kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra ray.init arguments


class GpuHosts:
    """Starts one host per GPU node (Ray actors or in-process) and closes them."""

    def __init__(self, config: GpuHostConfig):
        self.config = config
        self.handles: dict[str, LocalHandle | RayHandle] = {}
        self._connected_here = False

    def connect(self) -> None:
        if self.config.address is None:
            return
        import ray  # lazy: the ``ray`` extra

        if not ray.is_initialized():
            ray.init(address=self.config.address, namespace=self.config.namespace, log_to_driver=False,
                     **dict(self.config.init_kwargs))
            self._connected_here = True

    def start(self, node: str, num_gpus: int, memory_mb_per_gpu: int, models: Iterable[ModelSpec],
              model_options: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
        models = list(models)
        kw = {"executor": self.config.executor, "model_options": dict(model_options or {})}
        if self.config.address is None:
            h: Any = LocalHandle(GpuNodeHost(node, num_gpus, memory_mb_per_gpu, models, self.config.sim, **kw))
        else:
            h = self._start_actor(node, num_gpus, memory_mb_per_gpu, models, kw)
        self.handles[node] = h
        return h

    def _start_actor(self, node: str, num_gpus: int, memory_mb_per_gpu: int, models: list[ModelSpec],
                     kw: Mapping[str, Any]) -> RayHandle:
        import ray

        self.connect()
        name = f"{ACTOR_PREFIX}{node}"
        try:  # a host left by an earlier service has state our fresh books do not know: replace it
            ray.kill(ray.get_actor(name, namespace=self.config.namespace), no_restart=True)
        except ValueError:
            pass
        opts: dict[str, Any] = dict(name=name, namespace=self.config.namespace, num_cpus=0,
                                    max_restarts=-1, max_task_retries=0, max_concurrency=256)
        if self.config.resource == "GPU":
            opts["num_gpus"] = num_gpus
        else:
            opts["resources"] = {self.config.resource: num_gpus}
        actor = ray.remote(GpuNodeHost).options(**opts).remote(node, num_gpus, memory_mb_per_gpu, models,
                                                                dict(self.config.sim), **kw)
        return RayHandle(actor, name)

    async def close(self) -> None:
        for h in self.handles.values():
            h.kill()
        self.handles.clear()
        if self._connected_here:
            import ray

            ray.shutdown()
            self._connected_here = False


def build_remote_gpu(nodes: Sequence[Any], hosts: GpuHosts) -> tuple[Any, dict[str, GpuRunner], set[str]]:
    """GpuManager + a runner per node for ``GpuNodeConfig``-like nodes (name, gpus, memory_mb_per_gpu, services)."""
    from tangram.executors.simulated_gpu import SimGpuParams
    from tangram.managers.gpu import GpuManager, GpuNode

    specs: dict[str, ModelSpec] = {}
    options: dict[str, dict[str, Mapping[str, Any]]] = {}
    gnodes = []
    for n in nodes:
        for s in n.services:
            specs.setdefault(s.name, ModelSpec(name=s.name, state_mb=s.state_mb, sharded=s.sharded,
                                               overhead_mb=s.overhead_mb))
            options.setdefault(n.name, {})[s.name] = dict(s.options)
        mem = n.memory_mb_per_gpu or SimGpuParams().memory_mb_per_gpu
        gnodes.append(GpuNode(name=n.name, num_gpus=len(n.gpus), memory_mb_per_gpu=mem))
    manager = GpuManager(gnodes, specs.values())
    runners = {}
    for g in gnodes:
        handle = hosts.start(g.name, g.num_gpus, g.memory_mb_per_gpu, specs.values(), options.get(g.name))
        runners[g.name] = GpuRunner(manager, RemoteHost(handle, g.name), g.pool)
    return manager, runners, set(specs)
