"""The ``scheduler:`` section of the service's config: the policy's knobs (``PolicyParams``).

Each key is a field of :class:`tangram.service.config.ClusterConfig` of the same name; a bad
value is a :class:`ConfigError` naming ``scheduler.<key>`` and the reason.
"""
from __future__ import annotations

from typing import Any

from tangram.core.errors import ConfigError
from tangram.core.fields import Fields
from tangram.core.gaps import ARRIVAL_GAPS
from tangram.policy.snapshot import (DEFAULT_ARRIVAL_GAP, DEFAULT_GENERATION_CREDIT, DEFAULT_OFFERED_LOAD_CAPS,
                                     DEFAULT_RESTART_GAIN)

_FIELDS = Fields(ConfigError)
KEYS = frozenset({"depth", "lookahead", "default_duration_s", "dop_caps", "order", "aging_k", "aging_cap_s",
                  "progress_s", "generation_credit", "affinity_k", "expect_arrivals", "arrival_gap",
                  "offered_load_caps", "learn_unprofiled", "restart_gain"})
# the types whose elastic actions the offered-load cap may narrow (tangram.policy.offered_load)
ELASTIC_TYPES = ("cpu", "gpu")


def parse_scheduler(raw: Any) -> dict[str, Any]:
    """The ``scheduler:`` mapping as ClusterConfig's keyword arguments (every key, defaults filled in)."""
    f = _FIELDS
    sched = f.mapping(raw, "scheduler")
    f.known(sched, "scheduler", set(KEYS))
    out: dict[str, Any] = {  # validated in this order (a config with two errors names the first)
        "depth": f.integer(sched.get("depth", 2), "scheduler.depth", lo=1),
        "lookahead": f.integer(sched.get("lookahead", 32), "scheduler.lookahead", lo=0),
        "default_duration_s": f.positive(sched.get("default_duration_s", 1.0), "scheduler.default_duration_s"),
    }
    caps = f.mapping(sched.get("dop_caps", {}) or {}, "scheduler.dop_caps")
    out["dop_caps"] = {str(k): f.integer(v, f"scheduler.dop_caps.{k}", lo=1) for k, v in caps.items()}
    order = sched.get("order", "aging")
    if order not in ("fcfs", "aging"):
        raise ConfigError("scheduler.order", f"must be 'fcfs' or 'aging', got {order!r}")
    out["order"] = order
    out["aging_k"] = f.positive(sched.get("aging_k", 4.0), "scheduler.aging_k")
    cap = sched.get("aging_cap_s")
    out["aging_cap_s"] = None if cap is None else f.number(cap, "scheduler.aging_cap_s", lo=0)
    out["progress_s"] = f.number(sched.get("progress_s", 0.0), "scheduler.progress_s", lo=0)
    out["generation_credit"] = f.number(sched.get("generation_credit", DEFAULT_GENERATION_CREDIT),
                                        "scheduler.generation_credit", lo=0)
    out["affinity_k"] = f.number(sched.get("affinity_k", 4.0), "scheduler.affinity_k", lo=0)
    out["expect_arrivals"] = f.boolean(sched.get("expect_arrivals", True), "scheduler.expect_arrivals")
    gap = sched.get("arrival_gap", DEFAULT_ARRIVAL_GAP)
    if gap not in ARRIVAL_GAPS:
        raise ConfigError("scheduler.arrival_gap", f"must be one of {', '.join(ARRIVAL_GAPS)}, got {gap!r}")
    out["arrival_gap"] = gap
    out["learn_unprofiled"] = f.boolean(sched.get("learn_unprofiled", True), "scheduler.learn_unprofiled")
    out["restart_gain"] = gain = f.number(sched.get("restart_gain", DEFAULT_RESTART_GAIN), "scheduler.restart_gain",
                                          lo=0)
    if gain > 1:
        raise ConfigError("scheduler.restart_gain", f"must be <= 1 (a share of the time left), got {gain!r}")
    # {} turns the cap off; a null is refused (it would read as "the default" to some, "off" to others)
    loads = f.mapping(sched.get("offered_load_caps", DEFAULT_OFFERED_LOAD_CAPS), "scheduler.offered_load_caps")
    for k in loads:
        if k not in ELASTIC_TYPES:
            raise ConfigError(f"scheduler.offered_load_caps.{k}",
                              f"must name an elastic resource type ({' or '.join(ELASTIC_TYPES)})")
    out["offered_load_caps"] = {k: f.number(v, f"scheduler.offered_load_caps.{k}", lo=0) for k, v in loads.items()}
    return out
