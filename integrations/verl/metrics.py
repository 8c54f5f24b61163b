"""Tangram's per-step metrics in verl's logger (wandb, tensorboard, console, ...).

The processes that see Tangram's actions (verl's agent-loop and reward-loop
workers) are not the one that logs (the trainer). Each scored sample
:func:`publish`-es its actions' timings (and each failure a count); the
trainer's ``Tracking.log`` drains them into the step's metrics dict, under

* ``tangram/actions``        actions of the step (tools, setups, rewards)
* ``tangram/act_mean_s``     mean action completion time (queueing + execution + overhead, as the service counts it)
* ``tangram/exec_mean_s``    mean execution time
* ``tangram/queue_mean_s``   mean time an action waited for resources
* ``tangram/overhead_mean_s`` mean scheduling/transport overhead
* ``tangram/dop_mean``       mean degree of parallelism granted
* ``tangram/admission_wait_mean_s`` mean time an action waited in this client before the service
  took it (the service refused it for now: its queues were full; the other times start after)
* ``tangram/failed``         samples whose rollout or reward the service failed (they raised)

Transport: in a Ray job, one named actor (``tangram_metrics``, zero CPUs)
collects what every worker publishes; without Ray, this process does. The
hook is installed by :func:`integrations.verl.register` (the ``verl.plugins``
entry point with ``TANGRAM_ENABLED=1``; the trainer's process is reached by
nothing else, so without the plugin the metrics stay unlogged). It adds them
to the logs of a training step (those carrying ``training/global_step``; a
validation during training is logged with its step, so its actions count
there too) and, as ``val-tangram/*``, to a validation logged on its own (the
one before training). No verl import at module level.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterable, Mapping

log = logging.getLogger("integrations.verl")

ACTOR_NAME = "tangram_metrics"
_FIELDS = ("actions", "exec_s", "queued_s", "overhead_s", "admission_wait_s", "dop", "dop_n", "failed")


class Accumulator:
    """Sums since the last drain (also the body of the named Ray actor)."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(_FIELDS, 0.0)
        self.stop_reason: str | None = None  # a worker's guard tripped (integrations.verl.guard)

    def add(self, part: Mapping[str, float]) -> None:
        for k in _FIELDS:
            self.sums[k] += float(part.get(k, 0.0))

    def drain(self) -> dict[str, float]:
        out, self.sums = self.sums, dict.fromkeys(_FIELDS, 0.0)
        return out

    def trip(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    def tripped(self) -> str | None:
        return self.stop_reason

    def untrip(self) -> None:
        self.stop_reason = None


_LOCAL = Accumulator()
_actor: Any = None


def summarize(records: Iterable[Mapping[str, Any]], failed: int = 0) -> dict[str, float]:
    part = dict.fromkeys(_FIELDS, 0.0)
    for r in records:
        part["actions"] += 1
        part["exec_s"] += float(r.get("exec_s") or 0.0)
        part["queued_s"] += float(r.get("queued_s") or 0.0)
        part["overhead_s"] += float(r.get("overhead_s") or 0.0)
        part["admission_wait_s"] += float(r.get("admission_wait_s") or 0.0)
        if r.get("dop"):
            part["dop"] += float(r["dop"])
            part["dop_n"] += 1
    part["failed"] = float(failed)
    return part


def _ray():
    ray = sys.modules.get("ray")  # never import Ray here; a Ray worker has it loaded
    return ray if ray is not None and ray.is_initialized() else None


def _get_actor(ray: Any, create: bool) -> Any:
    global _actor
    if _actor is None:
        try:
            _actor = ray.get_actor(ACTOR_NAME)
        except ValueError:
            if not create:
                return None
            _actor = ray.remote(num_cpus=0)(Accumulator).options(name=ACTOR_NAME, get_if_exists=True).remote()
    return _actor


def publish(records: Iterable[Mapping[str, Any]], failed: int = 0) -> None:
    """Count one sample's actions (and failures) into the current step's metrics. Never raises."""
    global _actor
    part = summarize(records, failed)
    ray = _ray()
    for _ in range(2):  # a handle from an earlier Ray session fails once, then is looked up again
        try:
            if ray is not None:
                _get_actor(ray, create=True).add.remote(part)
                return
        except Exception:  # noqa: BLE001 - metrics must never fail a rollout; keep them in this process
            log.debug("tangram: metrics actor unavailable", exc_info=True)
            _actor = None
    _LOCAL.add(part)


def drain() -> dict[str, float]:
    """The ``tangram/*`` metrics of everything published since the last drain."""
    sums = _LOCAL.drain()
    ray = _ray()
    if ray is not None:
        try:
            actor = _get_actor(ray, create=False)
            if actor is not None:
                remote = ray.get(actor.drain.remote(), timeout=30)
                sums = {k: sums[k] + remote.get(k, 0.0) for k in _FIELDS}
        except Exception:  # noqa: BLE001
            log.warning("tangram: could not read the step's metrics from the %s actor", ACTOR_NAME, exc_info=True)
    n = sums["actions"]
    return {
        "tangram/actions": n,
        "tangram/act_mean_s": (sums["queued_s"] + sums["exec_s"] + sums["overhead_s"]) / n if n else 0.0,
        "tangram/exec_mean_s": sums["exec_s"] / n if n else 0.0,
        "tangram/queue_mean_s": sums["queued_s"] / n if n else 0.0,
        "tangram/overhead_mean_s": sums["overhead_s"] / n if n else 0.0,
        "tangram/admission_wait_mean_s": sums["admission_wait_s"] / n if n else 0.0,
        "tangram/dop_mean": sums["dop"] / sums["dop_n"] if sums["dop_n"] else 0.0,
        "tangram/failed": sums["failed"],
    }


_hooked = False
# run after every Tracking.log the hook wraps (integrations.verl.guard adds its check: a service that
# stayed down stops the training there, once the step's metrics are logged)
AFTER_LOG: list[Callable[[], None]] = []


def install_logger_hook() -> None:
    """Make verl's ``Tracking.log`` add the ``tangram/*`` metrics to every training step's dict. Idempotent."""
    global _hooked
    if _hooked:
        return
    from verl.utils.tracking import Tracking

    original = Tracking.log

    def log_with_tangram(self, data, step, backend=None):
        if isinstance(data, dict) and "training/global_step" in data:
            data.update(drain())
        elif isinstance(data, dict) and any(str(k).startswith("val-") for k in data):
            # a validation logged on its own (the one before training): its actions are its own, not
            # the first training step's
            data.update({f"val-{k}": v for k, v in drain().items()})
        out = original(self, data, step, backend=backend)
        for after in AFTER_LOG:
            after()
        return out

    log_with_tangram.__wrapped__ = original  # type: ignore[attr-defined]
    Tracking.log = log_with_tangram
    _hooked = True
