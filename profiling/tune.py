"""``tangram tune``: choose the scheduler's knobs for a workload on the simulator.

The knobs are :class:`tangram.policy.snapshot.PolicyParams`' ``depth`` (how
many remaining actions the ACT approximation lets try every unit count),
``lookahead`` (how many waiting actions it looks at) and ``dop_caps`` (a cap
on the key resource per elastic class). Optuna's TPE sampler searches them;
each trial runs the discrete-event simulator (``tangram.simulator``, the very
same engine and policy as the service, on a virtual clock) over a few seeds
and scores the mean action completion time (ACT). The defaults are enqueued
as the first trial, so the chosen values are never worse than the defaults on
the tuning seeds.

Calibrated profiles (a profile store written by ``tangram profile``) replace
the workload's elasticity and single-unit duration for the classes they name
(by class name, or through an explicit ``workload_class=profile_class`` map):
``E(m)`` becomes the measured table and the duration distribution is rescaled
so that its mean is the measured ``T1`` (``keep_durations`` keeps the
workload's own durations and takes only the elasticity).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from tangram.core.model import Elasticity
from tangram.policy.snapshot import PolicyParams

DEPTHS = (1, 2, 3)
LOOKAHEADS = (0, 4, 8, 16, 32, 64)
NO_CAP = 0  # the cap choice that means "no cap"


# --------------------------------------------------------------------------- #
# profiles -> workload


def _rescale(dist, mean: float):
    """The same distribution shape with its mean moved to ``mean``."""
    if dist.mean <= 0:
        return dist
    k = mean / dist.mean
    hi = dist.hi * k if math.isfinite(dist.hi) else dist.hi
    if dist.kind == "lognormal":
        return replace(dist, a=dist.a + math.log(k), lo=dist.lo * k, hi=hi, mean=mean)
    if dist.kind == "uniform":
        return replace(dist, a=dist.a * k, b=dist.b * k, lo=dist.lo * k, hi=hi, mean=mean)
    return replace(dist, a=dist.a * k, lo=dist.lo * k, hi=hi, mean=mean)


def apply_profiles(workload, store, *, mapping: Mapping[str, str] | None = None,
                   keep_durations: bool = False) -> tuple[Any, dict[str, str]]:
    """A copy of ``workload`` whose classes use the calibrated profiles.

    Returns the new workload and ``{workload class: profile class}`` applied.
    A mapped class that the store lacks is an error; unmapped classes are
    matched by name and left alone when the store has no such class.
    """
    mapping = dict(mapping or {})
    applied: dict[str, str] = {}

    def conv(cls):
        pname = mapping.get(cls.name, cls.name)
        entry = store.classes.get(pname)
        if entry is None:
            if cls.name in mapping:
                known = ", ".join(sorted(store.classes)) or "none"
                raise KeyError(f"profile class {pname!r} (for workload class {cls.name!r}) is not in the store "
                               f"(fitted classes: {known})")
            return cls
        applied[cls.name] = pname
        kw: dict[str, Any] = {"elasticity": Elasticity.from_table(entry["efficiency"]), "profiled": True}
        if not keep_durations:
            kw["duration"] = _rescale(cls.duration, float(entry["t1_s"]))
        return replace(cls, **kw)

    jobs = tuple(replace(j, actions=tuple(conv(c) for c in j.actions), rewards=tuple(conv(c) for c in j.rewards))
                 for j in workload.jobs)
    missing = set(mapping) - set(applied)
    if missing:
        raise KeyError(f"workload has no class named {sorted(missing)[0]!r}")
    return replace(workload, jobs=jobs), applied


def elastic_classes(workload) -> dict[str, int]:
    """Profiled elastic classes (the ones the scheduler scales) -> their largest feasible DoP."""
    out: dict[str, int] = {}
    for j in workload.jobs:
        for c in j.actions + j.rewards:
            if c.demand.elastic and c.elasticity is not None and c.profiled:
                node = workload.cluster.cores_per_node if c.rtype == "cpu" else workload.cluster.gpus_per_node
                top = min(c.demand.max, node) if node else c.demand.max
                out[c.name] = max(out.get(c.name, 0), top)
    return out


def cap_choices(top: int) -> list[int]:
    """NO_CAP, then 1, 2, 4, ... below ``top``."""
    out, m = [NO_CAP], 1
    while m < top:
        out.append(m)
        m *= 2
    return out


# --------------------------------------------------------------------------- #
# evaluation


def evaluate(workload, params: PolicyParams, seeds: Sequence[int]) -> dict[str, float]:
    """Simulated mean ACT (and step time) of ``params``, averaged over ``seeds``."""
    from tangram.simulator.policies import PolicySpec
    from tangram.simulator.sim import Simulation

    acts, steps = [], []
    for s in seeds:
        summary = Simulation(workload, PolicySpec("tangram", params=params), seed=s).run().summary
        acts.append(summary["mean_act_s"])
        steps.append(summary["step_time_s"])
    return {"mean_act_s": float(sum(acts) / len(acts)), "step_time_s": float(sum(steps) / len(steps))}


def params_dict(p: PolicyParams) -> dict[str, Any]:
    return {"depth": p.depth, "lookahead": p.lookahead, "dop_caps": dict(sorted(p.dop_caps.items()))}


@dataclass(slots=True)
class TuneResult:
    best: PolicyParams
    best_metrics: dict[str, float]
    default: PolicyParams
    default_metrics: dict[str, float]
    trials: int
    classes: dict[str, int] = field(default_factory=dict)

    @property
    def improvement(self) -> float:
        d = self.default_metrics["mean_act_s"]
        return (d - self.best_metrics["mean_act_s"]) / d if d > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"policy": params_dict(self.best), "mean_act_s": self.best_metrics["mean_act_s"],
                "step_time_s": self.best_metrics["step_time_s"],
                "default": {"policy": params_dict(self.default), **self.default_metrics},
                "improvement": self.improvement, "trials": self.trials}


def tune(workload, *, seeds: Sequence[int] = (0,), n_trials: int = 30, timeout_s: float | None = None,
         sampler_seed: int = 0, depths: Sequence[int] = DEPTHS, lookaheads: Sequence[int] = LOOKAHEADS,
         default: PolicyParams | None = None, on_trial: Callable[[int, float, float], None] | None = None) -> TuneResult:
    """Search depth, look-ahead and per-class DoP caps with optuna (TPE)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    default = default or PolicyParams()
    classes = elastic_classes(workload)
    cache: dict[tuple, dict[str, float]] = {}

    def params_of(trial) -> PolicyParams:
        caps = {}
        for name, top in sorted(classes.items()):
            cap = trial.suggest_categorical(f"cap:{name}", cap_choices(top))
            if cap != NO_CAP:
                caps[name] = int(cap)
        return replace(default, depth=trial.suggest_categorical("depth", list(depths)),
                       lookahead=trial.suggest_categorical("lookahead", list(lookaheads)), dop_caps=caps)

    best_so_far = [math.inf]

    def objective(trial) -> float:
        p = params_of(trial)
        key = (p.depth, p.lookahead, tuple(sorted(p.dop_caps.items())))
        if key not in cache:
            cache[key] = evaluate(workload, p, seeds)
        m = cache[key]
        trial.set_user_attr("step_time_s", m["step_time_s"])
        best_so_far[0] = min(best_so_far[0], m["mean_act_s"])
        if on_trial is not None:
            on_trial(trial.number, m["mean_act_s"], best_so_far[0])
        return m["mean_act_s"]

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=sampler_seed))
    first = {"depth": default.depth if default.depth in depths else list(depths)[0],
             "lookahead": default.lookahead if default.lookahead in lookaheads else list(lookaheads)[0]}
    for name in classes:
        first[f"cap:{name}"] = int(default.dop_caps.get(name, NO_CAP))
    study.enqueue_trial(first)
    study.optimize(objective, n_trials=n_trials, timeout=timeout_s)
    default_metrics = evaluate(workload, default, seeds)
    best = params_of(optuna.trial.FixedTrial(study.best_trial.params))
    best_metrics = cache.get((best.depth, best.lookahead, tuple(sorted(best.dop_caps.items())))) \
        or evaluate(workload, best, seeds)
    if default_metrics["mean_act_s"] <= best_metrics["mean_act_s"]:
        best, best_metrics = default, default_metrics  # never recommend something worse than the defaults
    return TuneResult(best, best_metrics, default, default_metrics, len(study.trials), classes)
