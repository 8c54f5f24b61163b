"""The compared systems: each a configuration of the same engine and policy.

=================  ==========================================================
``tangram``        elastic policy (``tangram.policy.schedule.plan``), action-
                   level pooling, GPU evict-on-execution, managed API quotas
``tangram:ORDER``  the same with the queue order ``fcfs`` (the paper's) or
                   ``aging`` (see ``tangram.policy.order``)
``fixed-dop:N``    same, with ``PolicyParams(fixed_dop=N)`` (the ablation)
``trajectory``     Kubernetes-like: a pod per trajectory. Its first CPU action
                   submits one non-elastic "pod" action (``pod_cores`` cores +
                   the trajectory's memory) to the engine; the pod starts after
                   a latency that grows with concurrent creations and is held
                   until the trajectory ends; every CPU action runs inside it
                   (elastic rewards use all the pod's cores)
``static-services`` SGLang-like: every GPU service on its own dedicated replicas
                   (fixed DoP); the engine sees one slot pool per service
``serverless``     ServerlessLLM-like: GPU pool shared, every service at its
                   fixed DoP (its ``static-services`` replicas' where the
                   workload gives one), loaded on demand from disk, one model
                   per GPU (no multi-model residency), no affinity in placement
``serverless:fewest`` the same, every service on the fewest GPUs its weights fit
                   (how ServerlessLLM would be deployed without a static sizing
                   to copy: more instances, each slower)
``api-naive``      API calls bypass the engine's quota manager; the API
                   answers 429 over its limits and callers retry with backoff,
                   giving up after ``max_retries`` (the call fails and its
                   trajectory goes on without the answer)
``api-retry``      the same client retrying until the call succeeds: it loses
                   no work, so its ACT and step compare like for like
=================  ==========================================================

No policy is re-implemented here: a baseline is the elastic ``plan`` with
other parameters, a filtered snapshot, or another manager configuration.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from tangram.policy.order import ORDERS
from tangram.policy.schedule import plan as elastic_plan
from tangram.policy.snapshot import Plan, PolicyParams, Snapshot
from tangram.simulator.errors import WorkloadError

POLICY_NAMES = ("tangram", "tangram:ORDER", "trajectory", "fixed-dop:N", "static-services", "serverless",
                "serverless:fewest", "api-naive", "api-retry")


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    plan: Callable[[Snapshot], Plan] = elastic_plan
    params: PolicyParams = PolicyParams()
    cpu_mode: str = "action"  # "action" | "pod"
    gpu_mode: str = "eoe"  # "eoe" | "static" | "serverless"
    api_mode: str = "managed"  # "managed" | "naive"
    api_gives_up: bool = True  # naive: a call fails after the workload's max_retries (False: retries until it succeeds)
    serverless_fewest: bool = False  # serverless: each service on the fewest GPUs it fits, not its replicas' DoP
    # eoe: each GPU node loads its models before the first request (tangram.managers.gpu_warm), on its GPUs;
    # the live service's default on CUDA devices too (gpu_nodes[].warm_start)
    gpu_warm: bool = True


def has_warm_start(spec: PolicySpec) -> bool:
    """Whether ``spec`` runs tangram's GPU manager, whose nodes a warm start loads; ``static-services`` and
    ``serverless`` keep GPUs of their own."""
    return spec.gpu_mode == "eoe"


def warm_started(spec: PolicySpec, warm: bool) -> PolicySpec:
    """``spec`` with its GPU nodes' warm start ``warm`` where it has one (``has_warm_start``), else as it is."""
    return replace(spec, gpu_warm=warm) if has_warm_start(spec) else spec


def _no_affinity(snap: Snapshot) -> Plan:
    """The elastic plan on a snapshot that hides GPU residency (no affinity)."""
    pools = {n: (replace(p, resident=frozenset(), idle=()) if (p.resident or p.idle) else p) for n, p in snap.pools.items()}
    return elastic_plan(replace(snap, pools=pools))


def policy_spec(name: str) -> PolicySpec:
    if name == "tangram":
        return PolicySpec(name)
    if name.startswith("tangram:"):
        order = name.split(":", 1)[1]
        if order not in ORDERS:
            raise WorkloadError("policy", f"tangram:ORDER needs one of {', '.join(ORDERS)}, got {name!r}")
        return PolicySpec(name, params=PolicyParams(order=order))
    if name == "trajectory":
        return PolicySpec(name, cpu_mode="pod")
    if name == "static-services":
        return PolicySpec(name, gpu_mode="static")
    if name == "serverless":
        return PolicySpec(name, plan=_no_affinity, gpu_mode="serverless")
    if name == "serverless:fewest":
        return PolicySpec(name, plan=_no_affinity, gpu_mode="serverless", serverless_fewest=True)
    if name == "api-naive":
        return PolicySpec(name, api_mode="naive")
    if name == "api-retry":
        return PolicySpec(name, api_mode="naive", api_gives_up=False)
    if name.startswith("fixed-dop:"):
        raw = name.split(":", 1)[1]
        if not raw.isdigit() or int(raw) < 1:
            raise WorkloadError("policy", f"fixed-dop needs a positive integer, e.g. fixed-dop:4, got {name!r}")
        return PolicySpec(name, params=PolicyParams(fixed_dop=int(raw)))
    raise WorkloadError("policy", f"unknown policy {name!r} (expected one of {', '.join(POLICY_NAMES)}, or all)")
