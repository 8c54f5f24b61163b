"""What the last scheduling round left, which the next events read to skip their round or narrow it.

The engine keeps one :class:`LastRound`. A full round replaces it (:meth:`LastRound.took`); a round
over some lanes (skips.replan_scope) replaces the part of it on their pools (:meth:`took_part`);
a release marks its pool (:meth:`release`); anything else that changes what a round reads
(a cancel, a requeue, new knobs) forgets it (:meth:`forget`). docs/scheduling.md, "What a round reads".
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Iterable, Mapping

from tangram.policy.snapshot import Plan

_NO_HOLDOUTS: Mapping[str, object] = MappingProxyType({})


class LastRound:
    __slots__ = ("unfit", "chosen", "released", "holdouts", "holdout_classes")

    def __init__(self) -> None:
        # what it could not start (Plan.unfit), minus the pools released since; None when
        # something else changed (a cancel, a tick, a new manager)
        self.unfit: dict[str, int] | None = None
        # the pools where something waits by the policy's choice outside a holdout: those a round
        # re-decides whatever else changed (unfit holds no entry for them)
        self.chosen: set[str] = set()
        # the pools released since it planned them (or whose expected arrivals changed)
        self.released: set[str] = set()
        # its Plan.holdouts: elastic groups it made wait in full, handed back to the next
        # round, which re-decides only those whose inputs changed
        self.holdouts: Mapping[str, object] = _NO_HOLDOUTS
        # the classes whose estimates they read, which a completion moves without a release
        self.holdout_classes: frozenset[str] = frozenset()

    @property
    def settled(self) -> bool:
        """Whether it left every waiting action waiting for units (none by the policy's choice, e.g. an
        elastic action holding out for more cores, except in holdouts), and still holds."""
        return self.unfit is not None and not self.chosen

    def forget(self) -> None:
        """Its leftovers, settledness and holdouts no longer hold: the next round re-decides all."""
        self.unfit, self.chosen = None, set()
        self.holdouts, self.holdout_classes = _NO_HOLDOUTS, frozenset()

    def took(self, result: Plan, pools: Mapping) -> None:
        """A full round over ``pools`` planned ``result``."""
        self.released.clear()
        self.holdouts = result.holdouts
        self.holdout_classes = result.holdout_classes
        unfit = self.unfit = dict(result.unfit)
        # an unfit entry for every pool: whatever still waits, waits for units, not by choice, or
        # waits in groups held out whose inputs a release elsewhere leaves as they are: the next
        # round would hold them again (the policy re-decides them on a change)
        self.chosen = set() if len(unfit) >= len(pools) and unfit.keys() >= pools.keys() else {
            p for p in pools if p not in unfit and p not in result.holdouts}

    def took_part(self, result: Plan, own: Iterable[str]) -> None:
        """A round over the lanes that could use the pools ``own`` (and no others) planned ``result``;
        what the last full round left on the other pools stands."""
        own = set(own)
        self.unfit = {p: u for p, u in self.unfit.items() if p not in own} | {
            p: result.unfit[p] for p in own if p in result.unfit}
        self.holdouts = MappingProxyType({p: h for p, h in self.holdouts.items() if p not in own} | dict(
            result.holdouts))
        self.holdout_classes |= result.holdout_classes  # a superset: more rounds run, none is missed
        self.chosen = (self.chosen - own) | {p for p in own if p not in self.unfit and p not in self.holdouts}
        self.released -= own  # planned now

    def release(self, pname: str) -> None:
        """Units of ``pname`` were given back (or its expected arrivals changed)."""
        self.released.add(pname)
        if self.unfit is not None:
            self.unfit.pop(pname, None)
