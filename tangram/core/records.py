"""What the engine keeps of one action (:class:`ActionRecord`) and hands its driver (:class:`Started`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from tangram.core.grants import Grant
from tangram.core.model import Action
from tangram.policy.snapshot import Dispatch

WAITING, RUNNING = "waiting", "running"
FINAL_STATES = frozenset({"succeeded", "failed", "timeout", "cancelled"})


@dataclass(slots=True, eq=False)
class ActionRecord:
    """What the engine knows of one action: its state, grants and timing."""

    action: Action
    submitted_at: float
    state: str = WAITING
    started_at: float | None = None
    finished_at: float | None = None
    dispatch: Dispatch | None = None
    grants: dict[str, Grant] = field(default_factory=dict)  # pool -> manager's grant
    estimated_end: float = 0.0
    error: str | None = None  # why it failed, when the driver said so (:meth:`Engine.fail`)
    restarted_s: float = 0.0  # seconds of runs stopped to start it again wider (core/restarts.py)

    @property
    def id(self) -> str:
        return self.action.id

    @property
    def queued_s(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.submitted_at - self.restarted_s

    @property
    def exec_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    @property
    def act_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    @property
    def dop(self) -> int | None:
        return None if self.dispatch is None else self.dispatch.dop


@dataclass(frozen=True, slots=True)
class Started:
    """An action the driver must run now, with the manager grants it holds."""

    record: ActionRecord
    dispatch: Dispatch
    grants: Mapping[str, Grant]
    # the driver holds a run of this action: stop it and start this (its grants changed in place: the
    # units the old run holds are still its own until it is gone)
    restart: bool = False

    @property
    def action(self) -> Action:
        return self.record.action


def check_grants(managers: Iterable[Any], running: Mapping[str, ActionRecord],
                 placed_mem: Mapping[str, tuple[str, int]]) -> None:
    """Each manager's books balance, and together they hold exactly the running actions' grants and
    the placed trajectories' memory (AssertionError naming what leaked or went missing)."""
    for m in managers:
        m.check_invariants()
    held = {(p, h) for m in managers for p, hs in m.held().items() for h in hs}
    expected = {(p, rid) for rid, rec in running.items() for p in rec.grants}
    expected |= {(mp, h) for h, (mp, _) in placed_mem.items()}
    if held and held != expected:
        raise AssertionError(f"grants out of sync: leaked {sorted(held - expected)}, missing {sorted(expected - held)}")
