"""Running duration estimates per action class.

Non-scalable actions (no profile) are estimated by the running average of
their class; profiled classes refine their single-unit duration ``T1`` from
observed runs (``T1 = T(m) * E(m) * m``), so a stale profile heals online:
once a class has ``refine_after`` observed runs, :meth:`DurationEstimator.refine`
gives each newly queued action of it the observed ``T1`` instead of its
profile's, and the policy sees that action (its DoP choice and its estimated
end) in the snapshot like any other. The observed ``T1`` replaces the profile's
only when they differ by more than ``refine_margin`` (2) standard errors of the
observed mean: a class whose runs vary (a lognormal cv of 0.6 gives a 3-run mean
a standard error of 35%) otherwise swapped an accurate profile for its first
draws, and the order key of every action queued meanwhile (fixed at submission)
with it. A stale profile still heals: 2x off at cv 0.6 after about 6 runs, at
once when the runs agree.

The class estimates the policy reads (:meth:`DurationEstimator.class_estimates`) are
republished only when a class's mean moves by more than ``publish_band`` (10%) of the
published value and by more than ``publish_margin`` (2) standard errors of the mean:
smaller moves are within the estimate's own noise (a class of cv 1.5 averaged over the
EMA's ~40-sample window has a standard error of ~24%), and each republication
re-decides the groups held out on it (docs/scheduling.md, "Holdouts").

An elastic action submitted without a profile (a DoP range, no ``T1`` or elasticity) used
to run at its smallest DoP for good: nothing told the policy a wider one helps. Its class is
now learned online (:meth:`DurationEstimator.refine`): its runs are averaged per DoP, and
once a run has been seen each new action of the class gets a ``T1`` and an Amdahl
elasticity. The serial fraction is fitted (``T(m) = a + b / m``, least squares over the
per-DoP plain means) once ``refine_after`` runs at each of two DoPs are seen; before that it is
``UNPROFILED_SERIAL_FRACTION``, a cautious guess (at most 2x from any width), so the policy
widens such an action only where the units would otherwise sit idle, and those runs are
the ones the fit learns from. Until one run has ended, the class's actions run at their
smallest DoP (``PolicyParams.learn_unprofiled`` False: every one does, as before). A class
name should not mix profiled and unprofiled actions: once an unprofiled one has run, every
elastic run of the class feeds the learned model.

At most ``max_classes`` classes are kept, the least recently observed one dropped
beyond that: a class name comes from the client, and one that names a new class per
action must not grow the service's memory with every action. A dropped class is
unobserved again (the policy's default estimate, its profile's ``T1``); the policy
would not have had any better for a class that rare.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from tangram.core.model import Action, Elasticity

# [reason] an unprofiled elastic class's serial fraction until its runs at two DoPs are seen: a
# speedup of at most 2x keeps its DoP near the smallest while other work waits
UNPROFILED_SERIAL_FRACTION = 0.5
# [reason] a spread read from fewer runs is noise: a restart acts on it (tangram.policy.restart)
CV_AFTER = 8
MAX_CLASSES = 10_000  # classes a deployment names are dozens; this bounds a client naming one per action


@dataclass(slots=True)
class _Mean:
    value: float = 0.0
    count: int = 0
    square: float = 0.0  # the same weighted mean of x * x (for the spread)

    def add(self, x: float, min_weight: float) -> None:
        self.count += 1
        w = max(1.0 / self.count, min_weight)  # a plain mean, then an EMA
        self.value += w * (x - self.value)
        self.square += w * (x * x - self.square)

    def standard_error(self, min_weight: float) -> float:
        """Of ``value``: the samples' spread over the samples it averages (an EMA of weight w
        averages about (2 - w) / w of them)."""
        n = float(self.count) if min_weight <= 0 else min(float(self.count), (2.0 - min_weight) / min_weight)
        var = max(self.square - self.value * self.value, 0.0) * self.count / max(self.count - 1, 1)
        return math.sqrt(var / n)


class DurationEstimator:
    """Class averages of observed execution time, and online ``T1`` refinement."""

    def __init__(self, *, min_weight: float = 0.05, refine_after: int = 3, publish_band: float = 0.1,
                 refine_margin: float = 2.0, publish_margin: float = 2.0, max_classes: int = MAX_CLASSES):
        if refine_after < 1:
            raise ValueError(f"refine_after: must be >= 1, got {refine_after}")
        if max_classes < 1:
            raise ValueError(f"max_classes: must be >= 1, got {max_classes}")
        self.max_classes = max_classes
        for name, margin in (("refine_margin", refine_margin), ("publish_margin", publish_margin)):
            if not margin >= 0.0 or math.isinf(margin):
                raise ValueError(f"{name}: must be a finite number >= 0, got {margin}")
        # standard errors by which the observed T1 must differ from the profile's to replace it, and
        # by which a class's mean must move (beyond publish_band) to be republished
        self.refine_margin = refine_margin
        self.publish_margin = publish_margin
        if not 0.0 <= publish_band < 1.0:
            raise ValueError(f"publish_band: must be in [0, 1), got {publish_band}")
        self.publish_band = publish_band
        self._min_weight = min_weight
        self.refine_after = refine_after
        self._durations: dict[str, _Mean] = {}  # least recently observed first (the next to drop)
        self._t1: dict[str, _Mean] = {}
        self._log_t1: dict[str, _Mean] = {}  # class -> plain mean of log T1 and of its square (t1_cv)
        self._by_dop: dict[str, dict[int, _Mean]] = {}  # unprofiled elastic class -> DoP -> its runs
        self._learned: dict[str, tuple[float, Elasticity]] = {}  # such a class -> its (T1, elasticity) now
        # the published means, updated in place: a copy per republication cost O(classes) each, and
        # a client that sent a new class per action made every completion O(actions so far)
        self._published: dict[str, float] = {}
        self._published_view: Mapping[str, float] = MappingProxyType(self._published)

    def observe(self, action: Action, units: int, exec_s: float) -> tuple[str, ...]:
        """Count one run; returns the classes whose published estimates (:meth:`class_estimates`)
        moved: the action's, and one dropped to make room for it (empty: none moved)."""
        if not exec_s > 0:
            return ()
        cls = action.action_class
        mean = self._durations.pop(cls, None) or _Mean()
        self._durations[cls] = mean  # now the most recently observed
        dropped = self._drop_oldest() if len(self._durations) > max(self.max_classes, 1) else ()
        mean.add(exec_s, self._min_weight)
        if units > 0 and action.key is not None and (action.t1_s is None or cls in self._learned):
            # an elastic run without a profile (or with the one learned here): kept per DoP (only
            # for a class kept in _durations, so at most max_classes), as a plain mean: a step's
            # last runs at a DoP are its longest (they started together and ended last), and an
            # EMA weighting them most read T1 1.5x too long on a workload
            runs = self._by_dop.setdefault(cls, {})
            runs.setdefault(units, _Mean()).add(exec_s, 0.0)
            self._learned[cls] = self._fit(runs)
        elif action.elasticity is not None and action.key is not None and units > 0:
            t1 = exec_s * action.elasticity.efficiency(units) * units
            self._t1.setdefault(cls, _Mean()).add(t1, self._min_weight)
        if action.elasticity is not None and action.key is not None and units > 0:
            # the spread of T1 in log space, over every run (a plain mean): a lognormal's sigma, what
            # a restart's expected time left is read from (t1_cv)
            self._log_t1.setdefault(cls, _Mean()).add(math.log(exec_s * action.elasticity.efficiency(units) * units),
                                                     0.0)
        published = self._published.get(cls)
        if published is not None and abs(mean.value - published) <= max(
                self.publish_band * published, self.publish_margin * mean.standard_error(self._min_weight)):
            return dropped
        self._published[cls] = mean.value
        return (cls, *dropped)

    def _drop_oldest(self) -> tuple[str, ...]:
        """Forget the least recently observed class; returns it if it had a published estimate."""
        old = next(iter(self._durations))
        del self._durations[old]
        self._t1.pop(old, None)
        self._log_t1.pop(old, None)
        self._by_dop.pop(old, None)
        self._learned.pop(old, None)
        return (old,) if self._published.pop(old, None) is not None else ()

    def classes(self) -> int:
        """How many classes are kept (at most ``max_classes``)."""
        return len(self._durations)

    def class_estimates(self) -> Mapping[str, float]:
        """The published means, a read-only view that follows republications: a snapshot reads it
        during its synchronous round, as it reads the engine's placement (nothing is observed
        meanwhile); :meth:`mean_duration` is the current mean."""
        return self._published_view

    def mean_duration(self, action_class: str) -> float | None:
        m = self._durations.get(action_class)
        return m.value if m else None

    def t1_cv(self, action_class: str) -> float | None:
        """The coefficient of variation of the class's ``T1`` across its elastic runs, read as a
        lognormal's from the variance of ``log T1`` (stable where a heavy tail makes the plain
        variance swing), once ``CV_AFTER`` runs have ended; else None. Runs still going are not in
        it: while a class's longest runs are out, it reads the spread short."""
        logs = self._log_t1.get(action_class)
        if logs is None or logs.count < CV_AFTER:
            return None
        var = max(logs.square - logs.value * logs.value, 0.0) * logs.count / (logs.count - 1)
        return math.sqrt(math.expm1(min(var, 50.0)))

    def refined_t1(self, action_class: str) -> float | None:
        m = self._t1.get(action_class)
        return m.value if m else None

    def _fit(self, runs: Mapping[int, _Mean]) -> tuple[float, Elasticity]:
        """``(T1, elasticity)`` of an unprofiled elastic class from its runs per DoP."""
        serial = UNPROFILED_SERIAL_FRACTION
        seen = {m: r for m, r in runs.items() if r.count >= self.refine_after}
        if len(seen) >= 2:  # T(m) = a + b / m, weighted by runs: a = T1 * s, b = T1 * (1 - s)
            w = sum(r.count for r in seen.values())
            xm = sum(r.count / m for m, r in seen.items()) / w
            ym = sum(r.count * r.value for r in seen.values()) / w
            sxx = sum(r.count * (1 / m - xm) ** 2 for m, r in seen.items())
            b = sum(r.count * (1 / m - xm) * (r.value - ym) for m, r in seen.items()) / sxx
            a = ym - b * xm
            # no speedup seen (b <= 0): as serial as Amdahl allows; a < 0 (noise): perfectly parallel
            serial = 0.99 if b <= 0 else min(0.99, max(0.0, a / (a + b)))  # b > 0: a + b >= T(min) > 0
        elasticity = Elasticity.amdahl(serial)
        n = sum(r.count for r in runs.values())
        t1 = sum(r.count * r.value / elasticity.duration(1.0, m) for m, r in runs.items()) / n
        return t1, elasticity

    def refine(self, action: Action, learn_unprofiled: bool = True) -> Action:
        """``action`` (a stale profile heals online) with its class's observed ``T1``, once there are
        ``refine_after`` runs of it; an unprofiled elastic one with its class's learned ``T1`` and
        elasticity once one has run (``learn_unprofiled``: ``PolicyParams.learn_unprofiled``)."""
        if learn_unprofiled and action.key is not None and action.t1_s is None and action.elasticity is None:
            learned = self._learned.get(action.action_class)
            if learned is None:
                return action
            return dataclasses.replace(action, t1_s=learned[0], elasticity=learned[1])
        if action.t1_s is None or action.elasticity is None or action.key is None:
            return action
        m = self._t1.get(action.action_class)
        if m is None or m.count < self.refine_after or not self.t1_differs(action.action_class, action.t1_s):
            return action
        return dataclasses.replace(action, t1_s=m.value)

    def t1_differs(self, action_class: str, t1_s: float) -> bool:
        """Whether the class's observed ``T1`` differs from ``t1_s`` by more than ``refine_margin``
        standard errors of its mean (no observation: False). Within that, the runs are no
        evidence that a profile of ``t1_s`` is stale."""
        m = self._t1.get(action_class)
        if m is None or m.value == t1_s:
            return False
        return abs(m.value - t1_s) > self.refine_margin * m.standard_error(self._min_weight)

    def samples(self, action_class: str) -> int:
        m = self._durations.get(action_class)
        return m.count if m else 0
