"""Discrete-event simulator: the real engine, policy and managers on a virtual clock.

``load_workload`` reads a built-in (``tangram/workloads/*.yaml``) or a user
YAML file; ``simulate(workload, policy, seed=...)`` runs its rollout steps and
returns a summary (ACT split into queueing and execution, step time, pool
utilisation, retries, and the lower bound). Policies: ``tangram``,
``trajectory``, ``fixed-dop:N``, ``static-services``, ``serverless``,
``api-naive``, ``api-retry`` (see :mod:`tangram.simulator.policies`).
"""
from tangram.simulator.errors import WorkloadError
from tangram.simulator.policies import POLICY_NAMES, policy_spec
from tangram.simulator.sim import SimResult, Simulation, simulate
from tangram.simulator.workload import Workload, builtin_names, load_cluster, load_workload

__all__ = ["POLICY_NAMES", "SimResult", "Simulation", "Workload", "WorkloadError", "builtin_names",
           "load_cluster", "load_workload", "policy_spec", "simulate"]
