"""What the simulator keeps per trajectory and per action, and the result of a run."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tangram.simulator.workload import ActionClass, Job


@dataclass(slots=True, eq=False)
class _Item:
    gen_s: float
    cls: ActionClass
    t1: float  # true single-unit duration (service scale applied)
    service: str | None
    lb: float = 0.0  # its fastest feasible run, never queued
    work: float = 0.0  # the fewest unit-seconds it can run in


@dataclass(slots=True, eq=False)
class _Traj:
    id: str
    job: Job
    items: list[_Item]
    step: int
    idx: int = 0
    pod: str | None = None  # "pending" | "creating" | "ready"
    pod_start: float = 0.0
    pending: "_Rec | None" = None
    env_started: bool = False
    mem_from: float = -1.0  # when its memory reservation began (placement), if it has one
    end: float = 0.0


@dataclass(slots=True, eq=False)
class _Rec:
    id: str
    traj: _Traj
    item: _Item | None
    rtype: str
    submit: float
    start: float = -1.0
    end: float = -1.0
    run_s: float = 0.0
    setup_s: float = 0.0
    restore_s: float = 0.0
    units: int = 0
    pool_units: int = 0  # units held in the engine's pool (reserved)
    retries: int = 0
    failed: bool = False
    lb: float = 0.0
    work: float = 0.0  # fewest unit-seconds it can run in
    attempt_start: float = -1.0
    due: float = -1.0  # when its run's FINISH is due (a restart makes that event stale)
    run_from: float = -1.0  # when its current run began, after a restart (-1: its start)
    restarts: int = 0


@dataclass
class SimResult:
    summary: dict[str, Any]
    records: list[_Rec] = field(repr=False, default_factory=list)
