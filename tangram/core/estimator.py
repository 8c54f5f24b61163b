"""Running duration estimates per action class.

Non-scalable actions (no profile) are estimated by the running average of
their class; profiled classes refine their single-unit duration ``T1`` from
observed runs (``T1 = T(m) * E(m) * m``), so a stale profile heals online.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from tangram.core.model import Action


@dataclass(slots=True)
class _Mean:
    value: float = 0.0
    count: int = 0

    def add(self, x: float, min_weight: float) -> None:
        self.count += 1
        w = max(1.0 / self.count, min_weight)  # a plain mean, then an EMA
        self.value += w * (x - self.value)


class DurationEstimator:
    """Class averages of observed execution time, and online ``T1`` refinement."""

    def __init__(self, *, min_weight: float = 0.05):
        self._min_weight = min_weight
        self._durations: dict[str, _Mean] = {}
        self._t1: dict[str, _Mean] = {}
        self._frozen: Mapping[str, float] = MappingProxyType({})

    def observe(self, action: Action, units: int, exec_s: float) -> None:
        if not exec_s > 0:
            return
        self._durations.setdefault(action.action_class, _Mean()).add(exec_s, self._min_weight)
        if action.elasticity is not None and action.key is not None and units > 0:
            t1 = exec_s * action.elasticity.efficiency(units) * units
            self._t1.setdefault(action.action_class, _Mean()).add(t1, self._min_weight)
        self._frozen = MappingProxyType({k: m.value for k, m in self._durations.items()})

    def class_estimates(self) -> Mapping[str, float]:
        """A read-only view for snapshots (rebuilt on change, shared otherwise)."""
        return self._frozen

    def mean_duration(self, action_class: str) -> float | None:
        m = self._durations.get(action_class)
        return m.value if m else None

    def refined_t1(self, action_class: str) -> float | None:
        m = self._t1.get(action_class)
        return m.value if m else None

    def samples(self, action_class: str) -> int:
        m = self._durations.get(action_class)
        return m.count if m else 0
