"""Building and validating actions for the runtime, and the shape of their results.

:func:`build_action` is the in-process API's validation (the HTTP layer
checks the body's shape first, then calls it too): every problem is a
:class:`~tangram.core.errors.DemandError` naming the field.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tangram.core.errors import DemandError, TangramError, UnschedulableError
from tangram.core.model import Action, Profile
from tangram.core.pools import PoolState

KINDS = ("exec", "http", "model")


class UnknownEnvironmentError(TangramError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown environment"


class ExecutorFailedError(TangramError):
    """An executor could not do its part outside of any action (e.g. creating an environment)."""


class ExecutorMissingError(DemandError):
    """The action's kind has no executor configured (e.g. ``model`` without GPUs)."""


@dataclass(slots=True)
class Timing:
    """Where an action's time went (seconds).

    ``queued_s``: waiting for resources (from the end of the submit round to
    the round that started it; 0 if it started at once).
    ``exec_s``: the executor's own run (the process / call / model batch).
    ``overhead_s``: everything else the system spent between receiving the
    action and having its result: parsing, the policy rounds, environment
    setup, cgroup placement, bookkeeping.
    """

    queued_s: float = 0.0
    exec_s: float = 0.0
    overhead_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"queued_s": self.queued_s, "exec_s": self.exec_s, "overhead_s": self.overhead_s}


@dataclass(slots=True)
class ActionOutcome:
    """The finished result of one action (the wire API's result object)."""

    id: str
    status: str
    exit_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    output: Any = None
    error: str | None = None
    allocation: dict[str, Any] = field(default_factory=dict)
    timing: Timing = field(default_factory=Timing)
    truncated: bool = False  # output past the executor's cap was dropped
    retryable: bool = False  # failed because its node or engine failed under it, not on its own: resubmit it

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "status": self.status}
        for k in ("exit_code", "stdout", "stderr", "output", "error"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.truncated:
            d["truncated"] = True
        if self.retryable:
            d["retryable"] = True
        d["allocation"] = self.allocation
        d["timing"] = self.timing.as_dict()
        return d


def build_action(
    kind: str,
    resources: Mapping[str, Any] | None,
    *,
    pools: Mapping[str, PoolState],
    models: frozenset[str] | None,
    profiles: Mapping[str, Profile],
    executors: frozenset[str],
    environment: str | None = None,
    environment_memory: Callable[[str], int] | None = None,
    command: str | None = None,
    profile: str | None = None,
    timeout_s: float | None = None,
    action_class: str | None = None,
    payload: Mapping[str, Any] | None = None,
    action_id: str | None = None,
    restore_estimate: Callable[[str], Mapping[int, float]] | None = None,
    restartable: bool = False,
    trajectory: str | None = None,
) -> Action:
    """Validate and build an action against what the cluster has.

    ``pools`` are the engine's pools, ``models`` what the GPU nodes serve
    (None: unchecked), ``executors`` the kinds that have an executor;
    ``environment_mb`` is the memory of the named (already looked up)
    environment.
    """
    if kind not in KINDS:
        raise DemandError("kind", f"must be one of {list(KINDS)}, got {kind!r}")
    res = dict(resources or {})
    demands: dict[str, Any] = {}
    for key, raw in res.items():
        if key in ("cpu", "gpu"):
            demands[key] = raw
        elif key == "api":
            if not isinstance(raw, str) or not raw:
                raise DemandError("resources.api", f"must be an API pool name, got {raw!r}")
            pool = raw if raw.startswith("api:") else f"api:{raw}"
            if pool not in pools:
                raise UnschedulableError("resources.api", f"no API pool named {pool[4:]!r} is configured")
            demands[pool] = 1
        elif key != "mem_mb":
            raise DemandError(f"resources.{key}", "unknown resource (expected cpu, gpu, api or mem_mb)")
    mem_mb = res.get("mem_mb", 0)
    if isinstance(mem_mb, bool) or not isinstance(mem_mb, int) or mem_mb < 0:
        raise DemandError("resources.mem_mb", f"must be a non-negative integer, got {mem_mb!r}")
    body = dict(payload or {})
    body["kind"] = kind
    if kind == "exec":
        if not isinstance(command, str) or not command.strip():
            raise DemandError("command", "an exec action needs a non-empty command string")
        body["command"] = command
        demands.setdefault("cpu", 1)
        if "gpu" in demands:
            raise DemandError("resources.gpu", "an exec action runs on CPU cores; use kind 'model' for GPUs")
    elif kind == "http":
        if not any(k.startswith("api:") for k in demands):
            apis = [p.name for p in pools.values() if p.rtype.startswith("api:")]
            if len(apis) != 1:
                raise DemandError("resources.api", "an http action needs the name of its API pool")
            demands[apis[0]] = 1
    elif kind == "model":
        demands.setdefault("gpu", 1)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise DemandError("model", "a model action names its model")
        if models is not None and model not in models:
            raise DemandError("model", f"unknown model {model!r} (served: {sorted(models)})")
    if environment is not None and kind != "exec":
        raise DemandError("environment", "only exec actions run inside an environment")
    if trajectory is not None and kind == "exec" and trajectory != environment:
        raise DemandError("trajectory", "an exec action's trajectory is its environment (give the same or none)")
    if trajectory is not None and kind != "exec" and ("cpu" in demands or mem_mb):
        # the engine keeps a trajectory's cores' node and memory until it closes: an environment's, not a call's
        raise DemandError("trajectory", "an http or model action that names a trajectory holds no cpu or mem_mb "
                                        "of its own (leave out one or the other)")
    if environment is not None and environment_memory is not None:
        mem_mb = environment_memory(environment)
    prof = None
    if profile is not None:
        prof = profiles.get(profile)
        if prof is None:
            raise DemandError("profile", f"unknown profile {profile!r}")
    action = Action.build(
        action_id or uuid.uuid4().hex,
        demands,
        action_class=action_class or profile or kind,
        trajectory=environment if kind == "exec" else trajectory,
        profile=prof,
        mem_mb=mem_mb,
        timeout_s=timeout_s,
        service=body.get("model") if kind == "model" else None,
        payload=body,
        # what a cache miss costs at each DoP: the policy weighs it against a resident chunk
        restore_s=(restore_estimate(body["model"]) or None) if (kind == "model" and restore_estimate) else None,
        restartable=restartable,
    )
    # checked after the demand itself, so a malformed demand is a 400 whatever is configured
    if kind == "http" and "http" not in executors:
        raise ExecutorMissingError("kind", "no HTTP executor is configured")
    if kind == "model" and "model" not in executors:
        raise ExecutorMissingError("kind", "no GPU model executor is configured")
    return action
